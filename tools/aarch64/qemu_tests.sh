#!/usr/bin/env bash
# Run an aarch64 wheel's Python package on this x86_64 machine: Debian bookworm's arm64 CPython
# 3.11 (unpacked, not installed), PyTorch's aarch64 CPU build and pytest (pip --platform, into
# the work folder), all under qemu-aarch64 (Debian: qemu-user; the aarch64 glibc of
# g++-aarch64-linux-gnu's sysroot). Then `flash-hopper info` and the C-ABI CPU tests (the
# library's load, tables, validation messages and backend policy) with the wheel's package.
#
# Usage: tools/aarch64/qemu_tests.sh WHEEL [--work DIR] [-- PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/../.."
wheel=""
work="build/qemu-aarch64"
pytest_args=(tests/test_lib.py tests/test_validate.py tests/test_mask_policy.py
             tests/test_fp8_validate.py tests/test_kvcache_validate.py
             tests/test_varlen_validate.py tests/test_mixed_validate.py)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --work) work="$2"; shift 2 ;;
    --) shift; pytest_args=("$@"); break ;;
    *) wheel="$1"; shift ;;
  esac
done
[[ -f "$wheel" ]] || { echo "qemu_tests: WHEEL (an aarch64 flash-hopper wheel) is required" >&2; exit 2; }
command -v qemu-aarch64 >/dev/null || { echo "qemu_tests: needs qemu-aarch64 (Debian: qemu-user)" >&2; exit 1; }
[[ -d /usr/aarch64-linux-gnu/lib ]] || { echo "qemu_tests: needs the aarch64 glibc in /usr/aarch64-linux-gnu (Debian: g++-aarch64-linux-gnu)" >&2; exit 1; }
mkdir -p "$work"
work="$(cd "$work" && pwd -P)"

if [[ ! -x "$work/root/usr/bin/python3.11" ]]; then
  # CPython and the libraries its standard modules load (ctypes: libffi; the rest as Debian has them)
  tools/debian_download.sh --work "$work" --suite bookworm --arch arm64 python3.11-minimal \
    libpython3.11-minimal libpython3.11-stdlib libexpat1 zlib1g libffi8 libssl3 libbz2-1.0 \
    liblzma5 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 libcrypt1 libnsl2 \
    libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 \
    libdb5.3 libgdbm6
  mkdir -p "$work/root"
  for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
fi
if [[ ! -d "$work/site/torch" ]]; then
  # --no-deps: pip would judge torch's markers by this x86_64 machine (CUDA wheels); its
  # dependencies are listed instead
  python3 -m pip install -q --no-deps --target "$work/site" --python-version 3.11 \
    --implementation cp --only-binary=:all: --platform manylinux_2_28_aarch64 \
    --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
    "torch==2.9.1" "numpy==2.2.6" "pytest==8.3.5" iniconfig packaging pluggy filelock \
    typing-extensions sympy mpmath networkx jinja2 MarkupSafe fsspec
fi
# argv[0] is the wrapper itself: sys.executable starts the same way (tests' subprocesses run
# emulated too)
cat > "$work/python" <<WRAP
#!/bin/sh
exec qemu-aarch64 -0 "$work/python" -L /usr/aarch64-linux-gnu \\
  -E LD_LIBRARY_PATH="$work/root/usr/lib/aarch64-linux-gnu:$work/root/lib/aarch64-linux-gnu" \\
  -E PYTHONHOME="$work/root/usr" -E PYTHONPATH="$work/site:\${PYTHONPATH:-}" \\
  -E PYTHONDONTWRITEBYTECODE=1 "$work/root/usr/bin/python3.11" "\$@"
WRAP
chmod +x "$work/python"
rm -rf "$work/package" && mkdir -p "$work/package"
python3 -m zipfile -e "$wheel" "$work/package"
export PYTHONPATH="$work/package" FLASH_HOPPER_REQUIRE_LIB=1
"$work/python" -c 'import platform, torch; print("python", platform.python_version(), platform.machine(), "torch", torch.__version__)'
"$work/python" -m flash_hopper info
"$work/python" -m pytest -q -p no:cacheprovider "${pytest_args[@]}"
