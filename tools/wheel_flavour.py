"""Give a built wheel the distribution name of its CUDA flavour (flash-hopper -> flash-hopper-cu12).

Why a rename after the build: pyproject.toml names the project `flash-hopper`, and PEP 621 forbids
a build-time (dynamic) name. The source distribution keeps that name and builds against whatever
CUDA toolkit the installing machine has; the binary wheels are published per CUDA major version
under their own names (flash-hopper-cu12, flash-hopper-cu13), because PyPI has one file per
(name, version, tag) and CUDA 12 and 13 builds of one version share every tag. Only the name
changes: same files, same import package (flash_hopper), same version and tags.

Usage: python tools/wheel_flavour.py --name flash-hopper-cu12 --out DIR WHEEL
Prints the path of the new wheel.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path


def normalized(name: str) -> str:
    """The wheel-file form of a distribution name (PEP 427/503): flash-hopper -> flash_hopper."""
    return re.sub(r"[-_.]+", "_", name).lower()


def record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def rename(wheel: Path, name: str, out_dir: Path) -> Path:
    parts = wheel.name[: -len(".whl")].split("-")
    if len(parts) != 5:
        raise SystemExit(f"wheel_flavour: {wheel.name}: expected NAME-VERSION-PY-ABI-PLATFORM.whl "
                         "(no build tag)")
    old_name, version, tags = parts[0], parts[1], "-".join(parts[2:])
    old_info = f"{old_name}-{version}.dist-info"
    new_info = f"{normalized(name)}-{version}.dist-info"
    target = out_dir / f"{normalized(name)}-{version}-{tags}.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        infos = src.infolist()
        if not any(i.filename.startswith(old_info + "/") for i in infos):
            raise SystemExit(f"wheel_flavour: {wheel.name} has no {old_info}/")
        for info in infos:
            if info.filename == f"{old_info}/RECORD":
                continue  # rewritten below: hashes of the renamed files
            data = src.read(info)
            path = info.filename
            if path.startswith(old_info + "/"):
                path = new_info + path[len(old_info):]
            if path == f"{new_info}/METADATA":
                text, count = re.subn(r"^Name: .*$", f"Name: {name}", data.decode(), count=1,
                                      flags=re.MULTILINE)
                if count != 1:
                    raise SystemExit(f"wheel_flavour: {wheel.name}: METADATA has no Name field")
                data = text.encode()
            new = zipfile.ZipInfo(path, date_time=info.date_time)
            new.external_attr = info.external_attr  # keeps the library's mode bits
            new.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(new, data)
            records.append(record_line(path, data))
        records.append(f"{new_info}/RECORD,,")
        record = zipfile.ZipInfo(f"{new_info}/RECORD", date_time=infos[-1].date_time)
        record.external_attr = 0o644 << 16
        dst.writestr(record, "\n".join(records) + "\n", zipfile.ZIP_DEFLATED)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="new distribution name, e.g. flash-hopper-cu12")
    ap.add_argument("--out", type=Path, required=True, help="folder for the renamed wheel")
    ap.add_argument("wheel", type=Path)
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", args.name):
        raise SystemExit(f"wheel_flavour: --name {args.name!r} is not a valid distribution name")
    print(rename(args.wheel, args.name, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
