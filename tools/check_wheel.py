"""Check a flash-hopper wheel (or a bare libflash_hopper.so) before it is published.

What a wheel promises and what this checks, each a line of the report and a failure if wrong:
  - tag: manylinux_2_28_<arch> in the file name, and `auditwheel show` finds the wheel consistent
    with manylinux_2_28 or an older (more compatible) policy;
  - glibc: the library requires no symbol version newer than GLIBC_2.28 (readelf -V);
  - dependencies: it needs no shared library beyond glibc's (libc, libm, libdl, libpthread, librt
    and the dynamic linker): libstdc++, libgcc_s and the CUDA runtime are linked statically and
    the driver (libcuda.so.1) is opened at run time;
  - exports: only the C ABI (fh_*), so the static runtimes inside stay private;
  - build_info: the CUDA major version of the flavour, the manylinux link, the GPU code asked for;
  - GPU code: the cubins and PTX cuobjdump lists (skipped without cuobjdump);
  - size: at most --max-mb.

Usage: python tools/check_wheel.py WHEEL_OR_SO [--cuda-major 12] [--gpu-code sm_80 ...]
           [--glibc 2.28] [--max-mb 150] [--no-auditwheel] [--arch x86_64|aarch64]
Needs binutils' readelf; auditwheel (pip install auditwheel) unless --no-auditwheel. An aarch64
library (cross-built) is loaded under qemu-aarch64 through tools/aarch64/abi_probe.c, built with
aarch64-linux-gnu-gcc (Debian: qemu-user, gcc-aarch64-linux-gnu).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

LIB_NAME = "libflash_hopper.so"
# glibc's own libraries: the ones manylinux lets a wheel take from the system (the dynamic
# linker appears because thread-local storage calls its __tls_get_addr).
GLIBC_LIBS = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
DYNAMIC_LINKER = {"x86_64": "ld-linux-x86-64.so.2", "aarch64": "ld-linux-aarch64.so.1"}
ROOT = Path(__file__).resolve().parents[1]


def glibc_libs(arch: str) -> tuple[str, ...]:
    return (*GLIBC_LIBS, DYNAMIC_LINKER[arch])


def platform_tag(arch: str, glibc: str = "2.28") -> str:
    return f"manylinux_{glibc.replace('.', '_')}_{arch}"


@dataclass
class ElfReport:
    needed: list[str]
    versions: dict[str, set[str]] = field(default_factory=dict)  # library -> required versions
    exports: list[str] = field(default_factory=list)


def _readelf(*args: str) -> str:
    exe = shutil.which("readelf")
    if exe is None:
        raise SystemExit("check_wheel: readelf not found (install binutils)")
    env = dict(os.environ, LC_ALL="C")
    return subprocess.run([exe, "-W", *args], capture_output=True, text=True, check=True,
                          env=env).stdout


def elf_report(path: Path) -> ElfReport:
    """NEEDED entries, required symbol versions per library and exported symbols of an ELF."""
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf("-d", str(path)))
    versions: dict[str, set[str]] = {}
    current = None
    for line in _readelf("-V", str(path)).splitlines():
        m = re.search(r"File: (\S+)\s+Cnt:", line)
        if m:
            current = m.group(1)
            versions.setdefault(current, set())
            continue
        m = re.search(r"Name: (\S+)\s+Flags:", line)
        if m and current is not None:
            versions[current].add(m.group(1))
    exports = []
    for line in _readelf("--dyn-syms", str(path)).splitlines():
        cols = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(cols) >= 8 and cols[0].endswith(":") and cols[6] != "UND" and \
                cols[4] in ("GLOBAL", "WEAK") and cols[3] != "SECTION":
            exports.append(cols[7].split("@")[0])
    return ElfReport(needed=needed, versions=versions, exports=sorted(set(exports)))


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def elf_problems(report: ElfReport, glibc: str = "2.28",
                 allowed: tuple[str, ...] = glibc_libs("x86_64")) -> list[str]:
    """Why this ELF would not load on every glibc >= `glibc` system, or why it leaks symbols;
    [] when neither."""
    problems = []
    extra = [n for n in report.needed if n not in allowed]
    if extra:
        problems.append(f"needs shared libraries beyond glibc's: {extra} "
                        f"(allowed: {list(allowed)})")
    newest = _version_tuple(glibc)
    for lib, names in sorted(report.versions.items()):
        for name in sorted(names):
            m = re.fullmatch(r"GLIBC_(\d+(?:\.\d+)+)", name)
            if m is None:
                problems.append(f"requires {name} from {lib}: only GLIBC_* versions may be "
                                "required (libstdc++/libgcc must be linked statically)")
            elif _version_tuple(m.group(1)) > newest:
                problems.append(f"requires {name} from {lib}, newer than glibc {glibc}")
    leaked = [s for s in report.exports if not s.startswith("fh_")]
    if leaked:
        shown = ", ".join(leaked[:8]) + (f" and {len(leaked) - 8} more" if len(leaked) > 8 else "")
        problems.append(f"exports symbols besides the C ABI (fh_*): {shown}")
    return problems


def newest_glibc(report: ElfReport) -> str:
    found = [n[len("GLIBC_"):] for names in report.versions.values() for n in names
             if re.fullmatch(r"GLIBC_\d+(\.\d+)+", n)]
    return max(found, key=_version_tuple) if found else "none"


def auditwheel_tag(wheel: Path) -> tuple[str | None, str]:
    """(the platform tag auditwheel finds the wheel consistent with, its full output)."""
    proc = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                          capture_output=True, text=True, check=False)
    text = proc.stdout + proc.stderr
    m = re.search(r'consistent\s+with\s+the\s+following\s+platform\s+tag:\s+"([^"]+)"', text)
    return (m.group(1) if m else None), text


def build_info(lib: Path) -> dict:
    """fh_build_info() of the library: loading it needs no GPU (the runtime starts lazily)."""
    dll = ctypes.CDLL(str(lib))
    dll.fh_build_info.restype = ctypes.c_char_p
    return json.loads(dll.fh_build_info().decode())


def probe_under_qemu(lib: Path, arch: str, work: Path) -> dict:
    """The C ABI's answers of a library of another architecture (tools/aarch64/abi_probe.c, built
    with <arch>-linux-gnu-gcc and run under qemu-<arch> on the cross toolchain's glibc): abi,
    build_info, has_fwd_bf16_d64_fa3, decode_stages_d128."""
    cc, qemu = shutil.which(f"{arch}-linux-gnu-gcc"), shutil.which(f"qemu-{arch}")
    if cc is None or qemu is None:
        raise SystemExit(f"check_wheel: --arch {arch} needs {arch}-linux-gnu-gcc and qemu-{arch} "
                         "on PATH (Debian: gcc-aarch64-linux-gnu, qemu-user)")
    exe = work / "abi_probe"
    subprocess.run([cc, "-O1", "-o", str(exe), str(ROOT / "tools" / "aarch64" / "abi_probe.c"),
                    "-ldl"], check=True)
    proc = subprocess.run([qemu, "-L", f"/usr/{arch}-linux-gnu", str(exe), str(lib)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"check_wheel: the library did not load under qemu-{arch} "
                         f"({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def gpu_code(lib: Path) -> list[str] | None:
    """Targets of the cubins and PTX inside, e.g. ['sm_80', 'compute_80'] (None: no cuobjdump)."""
    exe = shutil.which("cuobjdump")
    if exe is None:
        return None
    out = subprocess.run([exe, "--list-elf", "--list-ptx", str(lib)], capture_output=True,
                         text=True, check=False).stdout
    found = set(re.findall(r"\.(sm_\d+a?)\.cubin", out))
    found |= {"compute_" + m for m in re.findall(r"\.sm_(\d+a?)\.ptx", out)}
    return sorted(found)


def check(path: Path, args: argparse.Namespace) -> list[str]:
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fh-check-") as tmp:
        if path.suffix == ".whl":
            size_mb = path.stat().st_size / 2**20
            print(f"{path.name}: {size_mb:.1f} MB")
            if size_mb > args.max_mb:
                problems.append(f"wheel is {size_mb:.1f} MB, over the {args.max_mb} MB budget")
            tag_wanted = platform_tag(args.arch, args.glibc)
            if not path.name.endswith(f"-py3-none-{tag_wanted}.whl"):
                problems.append(f"file name does not end in -py3-none-{tag_wanted}.whl")
            with zipfile.ZipFile(path) as z:
                members = [n for n in z.namelist() if n.endswith("/" + LIB_NAME)]
                if members != [f"flash_hopper/{LIB_NAME}"]:
                    found = f"expected flash_hopper/{LIB_NAME} in the wheel, found {members}"
                    return [*problems, found]
                lib = Path(z.extract(members[0], tmp))
            if args.auditwheel:
                tag, text = auditwheel_tag(path)
                print("auditwheel show:\n  " + "\n  ".join(text.strip().splitlines()))
                m = re.fullmatch(rf"manylinux_(\d+)_(\d+)_{args.arch}", tag or "")
                if m is None:
                    problems.append(f"auditwheel found no manylinux tag for the wheel ({tag})")
                elif (int(m.group(1)), int(m.group(2))) > _version_tuple(args.glibc):
                    problems.append(f"auditwheel: consistent with {tag} only, newer than "
                                    f"manylinux_{args.glibc.replace('.', '_')}")
        else:
            lib = path
        report = elf_report(lib)
        print(f"{LIB_NAME}: needs {report.needed}; newest glibc symbol version "
              f"{newest_glibc(report)}; exports {report.exports}")
        problems += elf_problems(report, args.glibc, glibc_libs(args.arch))
        if args.arch == os.uname().machine:
            info = build_info(lib)
        else:
            probe = probe_under_qemu(lib, args.arch, Path(tmp))
            info = probe["build_info"]
            print(f"qemu-{args.arch}: loaded; abi {probe['abi']}, a bf16 d64 FA-3 forward "
                  f"{'present' if probe['has_fwd_bf16_d64_fa3'] else 'absent'}, decode stages "
                  f"(d128, 227 KB) {probe['decode_stages_d128']}")
            if probe["abi"] <= 0:
                problems.append(f"fh_abi_version() under qemu-{args.arch}: {probe['abi']}")
        print(f"build_info: cuda {info.get('cuda')}, link {info.get('link')}, gpu_code "
              f"{info.get('gpu_code')}, archs {info.get('archs')}, dtypes {info.get('dtypes')}, "
              f"head dims {info.get('head_dims')}")
        expected_link = f"manylinux_{args.glibc.replace('.', '_')}"
        if info.get("link") != expected_link:
            problems.append(f"build_info link is {info.get('link')!r}, expected {expected_link!r}")
        if args.cuda_major is not None:
            major = str(info.get("cuda", "")).split(".")[0]
            if major != str(args.cuda_major):
                problems.append(f"built with CUDA {info.get('cuda')}, expected CUDA "
                                f"{args.cuda_major}.x")
        missing = sorted(set(args.gpu_code) - set(info.get("gpu_code", [])))
        if missing:
            problems.append(f"build_info gpu_code {info.get('gpu_code')} lacks {missing}")
        listed = gpu_code(lib)
        if listed is None:
            print("GPU code: cuobjdump not on PATH, not listed")
        else:
            print(f"GPU code (cuobjdump): {listed}")
            if sorted(set(args.gpu_code) - set(listed)):
                problems.append(f"cuobjdump lists {listed}, lacking "
                                f"{sorted(set(args.gpu_code) - set(listed))}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", type=Path, nargs="+", help="wheels or libflash_hopper.so files")
    ap.add_argument("--glibc", default="2.28", help="newest glibc version allowed (2.28)")
    ap.add_argument("--cuda-major", type=int, help="CUDA major version the build must have")
    ap.add_argument("--gpu-code", nargs="*", default=[],
                    help="GPU code that must be inside, e.g. sm_80 sm_90 compute_80 sm_90a")
    ap.add_argument("--max-mb", type=float, default=150.0, help="wheel size budget (150 MB)")
    ap.add_argument("--no-auditwheel", dest="auditwheel", action="store_false",
                    help="skip `auditwheel show`")
    ap.add_argument("--arch", default=os.uname().machine, choices=sorted(DYNAMIC_LINKER),
                    help="the library's architecture (default: this machine's)")
    args = ap.parse_args(argv)
    failed = 0
    for path in args.paths:
        problems = check(path, args)
        for p in problems:
            print(f"FAIL {path.name}: {p}")
        print(f"{'FAIL' if problems else 'ok'}: {path.name}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
