"""Write the link-time glibc of an older release: stub libraries and libc_nonshared.a.

A shared library linked against the glibc of the build machine records, for every libc function
it calls, the newest symbol version that glibc has (pthread_create@GLIBC_2.34 on glibc >= 2.34),
and then refuses to load where glibc is older. Linked against stubs of glibc 2.28 instead, the
same calls record the 2.28 versions (pthread_create@GLIBC_2.2.5 in libpthread.so.0), which every
glibc since 2.28 still provides. Zig (the `ziglang` wheel, pip-installable everywhere) generates
such stubs for any glibc version from its symbol tables; this script asks it to and copies them,
plus the libc_nonshared.a of that version, into one folder that `-L` can point at. Nothing of
them ends up in the library: the stubs carry symbols and versions only.

Usage: python glibc_stubs.py --glibc 2.28 --out DIR [--arch x86_64|aarch64]
                              [--zig 'python -m ziglang']
The folder then holds libc.so (a linker script), libc.so.6, libm.so(.6), libpthread.so(.0),
libdl.so(.2), librt.so(.1), the dynamic linker (ld-linux-x86-64.so.2 / ld-linux-aarch64.so.1)
and libc_nonshared.a. --arch: the target's (a cross build passes aarch64); default this machine's.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The dynamic linker's name per target architecture (zig writes its stub as libld.so.2).
DYNAMIC_LINKER = {"x86_64": "ld-linux-x86-64.so.2", "aarch64": "ld-linux-aarch64.so.1"}


def stubs_of(arch: str) -> dict[str, tuple[str, str | None]]:
    """Stub file zig writes -> (name in --out, name of the -l link alias or None)."""
    return {
        "libc.so.6": ("libc.so.6", None),  # libc.so is a linker script, written below
        "libm.so.6": ("libm.so.6", "libm.so"),
        "libpthread.so.0": ("libpthread.so.0", "libpthread.so"),
        "libdl.so.2": ("libdl.so.2", "libdl.so"),
        "librt.so.1": ("librt.so.1", "librt.so"),
        "libld.so.2": (DYNAMIC_LINKER[arch], None),  # the dynamic linker: __tls_get_addr
    }


NONSHARED = "libc_nonshared.a"


def zig_link_line(zig: list[str], target: str, work: Path) -> list[str]:
    """The ld.lld command zig runs to link a probe library against the target's libc."""
    probe = work / "probe.c"
    probe.write_text("int fh_probe(void) { return 0; }\n")
    env = dict(os.environ)
    # Zig's caches in the work folder: nothing written to the user's home.
    env["ZIG_GLOBAL_CACHE_DIR"] = str(work / "zig-global-cache")
    env["ZIG_LOCAL_CACHE_DIR"] = str(work / "zig-local-cache")
    cmd = [*zig, "cc", "-target", target, "-shared", "-nostdlib", "-fno-sanitize=all", "-v",
           "-o", str(work / "probe.so"), str(probe), "-lc", "-lm", "-lpthread", "-ldl", "-lrt"]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"glibc_stubs: `{shlex.join(cmd)}` failed ({proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
    for line in (proc.stderr + proc.stdout).splitlines():
        words = shlex.split(line)
        if words and words[0].endswith("ld.lld") and "-o" in words and \
                words[words.index("-o") + 1].endswith("probe.so"):
            return words
    raise SystemExit("glibc_stubs: zig printed no link command for the probe (expected a line "
                     f"starting with ld.lld and '-o .../probe.so'); its output was:\n{proc.stderr}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--glibc", default="2.28", help="glibc version to target (default 2.28)")
    ap.add_argument("--out", type=Path, required=True, help="folder to write the stubs into")
    ap.add_argument("--arch", default=platform.machine(),
                    help="target architecture, x86_64 or aarch64 (default: this machine's)")
    ap.add_argument("--zig", default=f"{shlex.quote(sys.executable)} -m ziglang",
                    help="command that runs zig (default: this Python's ziglang module)")
    args = ap.parse_args(argv)

    if args.arch not in DYNAMIC_LINKER:
        raise SystemExit(f"glibc_stubs: --arch {args.arch!r}: expected one of "
                         f"{', '.join(DYNAMIC_LINKER)}")
    stubs = stubs_of(args.arch)
    target = f"{args.arch}-linux-gnu.{args.glibc}"
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fh-glibc-stubs-", dir=out) as tmp:
        words = zig_link_line(shlex.split(args.zig), target, Path(tmp))
        found = {}
        for w in words:
            name = Path(w).name
            if name in stubs or name == NONSHARED:
                found[name] = Path(tmp, w)  # zig prints paths relative to its working folder
        missing = sorted((set(stubs) | {NONSHARED}) - set(found))
        if missing:
            raise SystemExit(f"glibc_stubs: zig's link line for {target} lacks {missing}: "
                             f"{shlex.join(words)}")
        for name, src in found.items():
            dest = NONSHARED if name == NONSHARED else stubs[name][0]
            shutil.copyfile(src, out / dest)
            alias = stubs.get(name, (None, None))[1]
            if alias:
                (out / alias).unlink(missing_ok=True)
                (out / alias).symlink_to(dest)
    # What `-lc` means: the shared stub, the static part of that glibc (atexit, the stat
    # wrappers of glibc < 2.33: fstat64 -> __fxstat64) and the dynamic linker when needed.
    (out / "libc.so").write_text(
        f"/* glibc {args.glibc} link stubs for {target}, written by {Path(__file__).name} */\n"
        f"GROUP ( {out}/libc.so.6 {out}/{NONSHARED} "
        f"AS_NEEDED ( {out}/{DYNAMIC_LINKER[args.arch]} ) )\n")
    (out / "GLIBC_VERSION").write_text(args.glibc + "\n")
    print(f"glibc_stubs: glibc {args.glibc} stubs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
