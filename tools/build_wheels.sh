#!/usr/bin/env bash
# Build the release wheels: one per CUDA flavour, manylinux_2_28, checked.
#
#   flash-hopper-cu13  built with the CUDA 13 toolkit on PATH (or --cuda13 ROOT); drivers >= 580
#   flash-hopper-cu12  built with a CUDA 12 toolkit (--cuda12 ROOT; tools/cuda12_toolkit.sh
#                      assembles one); drivers >= 525.60.13
#
# Each flavour is `pip wheel .` with FH_MANYLINUX=1 (pyproject.toml: the glibc 2.28 link and the
# manylinux_2_28 tag) and its own build folder, then tools/wheel_flavour.py gives the wheel its
# distribution name and tools/check_wheel.py checks it (auditwheel show, glibc symbol versions,
# shared-library dependencies, exports, GPU code, size). No auditwheel repair is needed: the
# library already depends on nothing outside glibc, so there is nothing to vendor.
#
# Usage: tools/build_wheels.sh [--flavour cu12|cu13|all] [--cuda12 ROOT] [--cuda13 ROOT]
#          [--arch x86_64|aarch64] [--out DIR] [--reduced] [--sdist]
#   --arch aarch64  cross-build the wheels for aarch64 hosts (Grace-Hopper) on this x86_64
#              machine: Debian's g++-aarch64-linux-gnu as the host compiler, nvcc's aarch64 target
#              folder from tools/aarch64/cuda_target.sh (NVIDIA's aarch64 runtime wheel)
#   --reduced  one FA-2 and one FA-3 kernel (bf16, head dim 64), as CI builds: minutes, not 15+
#   --sdist    also write the source distribution (flash_hopper-VERSION.tar.gz) to --out
# The FH_* kernel-set variables (README) pass through, e.g. FH_HEAD_DIMS=128.
set -euo pipefail
cd "$(dirname "$0")/.."

flavours="all"
cuda12=""
cuda13=""
out="dist"
reduced=0
sdist=0
arch="x86_64"
usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --flavour) flavours="$2"; shift 2 ;;
    --cuda12) cuda12="$2"; shift 2 ;;
    --cuda13) cuda13="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    --reduced) reduced=1; shift ;;
    --sdist) sdist=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build_wheels: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$flavours" in
  all) flavours="cu13 cu12" ;;
  cu12|cu13) ;;
  *) echo "build_wheels: --flavour must be cu12, cu13 or all, got '$flavours'" >&2; exit 2 ;;
esac
case "$arch" in
  x86_64) ;;
  aarch64)
    command -v aarch64-linux-gnu-g++ > /dev/null || {
      echo "build_wheels: --arch aarch64 needs aarch64-linux-gnu-g++ (Debian: g++-aarch64-linux-gnu)" >&2
      exit 1
    } ;;
  *) echo "build_wheels: --arch must be x86_64 or aarch64, got '$arch'" >&2; exit 2 ;;
esac
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# The checker's tools (auditwheel) in a venv of their own, not in the user's environment.
tools_venv="build/wheel-tools"
if [[ ! -x "$tools_venv/bin/auditwheel" ]]; then
  python3 -m venv "$tools_venv"
  "$tools_venv/bin/python" -m pip install -q "auditwheel>=6.1"
fi

# One CUTLASS folder for every build: pip's isolated build environments live at random paths, and
# a CUTLASS include path that changed would recompile every kernel on the next run (CI does the
# same). The version is the one build-system.requires pins.
if [[ -z "${CUTLASS_DIR:-}" ]]; then
  cutlass_pin="$(grep -o 'nvidia-cutlass==[0-9.]*' pyproject.toml | head -n 1)"
  "$tools_venv/bin/python" -m pip install -q "$cutlass_pin"
  CUTLASS_DIR="$("$tools_venv/bin/python" -c 'import cutlass_library as c, os
print(os.path.join(os.path.dirname(c.__file__), "source"))')"
  export CUTLASS_DIR
fi

if [[ $reduced == 1 ]]; then
  export FH_ARCHS="${FH_ARCHS:-80;90a}" FH_HEAD_DIMS="${FH_HEAD_DIMS:-64}"
  export FH_DTYPES="${FH_DTYPES:-bf16}"
  export FH_FA3_ABLATION_HEAD_DIMS="${FH_FA3_ABLATION_HEAD_DIMS:-none}"
fi
export FH_MANYLINUX=1

nvcc_of() {  # nvcc of a flavour: --cudaNN ROOT, else (cu13 only) the one on PATH
  local root="$1"
  if [[ -n "$root" ]]; then
    echo "$(cd "$root" && pwd)/bin/nvcc"  # absolute: CMake caches it and runs elsewhere
  else
    command -v nvcc || true
  fi
}

for flavour in $flavours; do
  major="${flavour#cu}"
  if [[ $flavour == cu12 ]]; then
    if [[ -z "$cuda12" ]]; then
      echo "build_wheels: cu12 needs --cuda12 ROOT (tools/cuda12_toolkit.sh --prefix ROOT)" >&2
      exit 2
    fi
    nvcc="$(nvcc_of "$cuda12")"
  else
    nvcc="$(nvcc_of "$cuda13")"
  fi
  [[ -x "$nvcc" ]] || { echo "build_wheels: $flavour: no nvcc at '$nvcc'" >&2; exit 1; }
  release="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')"
  if [[ "${release%%.*}" != "$major" ]]; then
    echo "build_wheels: $flavour needs a CUDA $major toolkit; $nvcc is CUDA $release" >&2
    exit 1
  fi
  echo "build_wheels: $flavour ($arch) with $nvcc (CUDA $release)"
  build_dir="build/wheel-$flavour"
  cross=()
  if [[ $arch == aarch64 ]]; then
    build_dir="build/wheel-$flavour-aarch64"
    # FH_CUDA_TARGET_DIR=... and FH_CUDA_TOOLKIT_TOP=... for tools/aarch64/toolchain.cmake
    while IFS= read -r line; do export "${line?}"; done < <(
      tools/aarch64/cuda_target.sh --nvcc "$nvcc" --out "build/cuda-sbsa-$flavour")
    cross=(env FH_CROSS_AARCH64=1)
  fi
  tmp="$(mktemp -d)"
  start=$(date +%s)
  "${cross[@]}" env CUDACXX="$nvcc" python3 -m pip wheel . --no-deps -w "$tmp" \
    -C build-dir="$build_dir" -C cmake.define.CMAKE_CUDA_COMPILER="$nvcc"
  echo "build_wheels: $flavour built in $(( $(date +%s) - start )) s"
  wheel="$(python3 tools/wheel_flavour.py --name "flash-hopper-$flavour" --out "$out" \
           "$tmp"/flash_hopper-*.whl)"
  rm -rf "$tmp"
  expect_code=()
  [[ $reduced == 1 ]] || expect_code=(--gpu-code sm_80 sm_90 compute_80 sm_90a)
  "$tools_venv/bin/python" tools/check_wheel.py "$wheel" --cuda-major "$major" --arch "$arch" \
    "${expect_code[@]}"
done

if [[ $sdist == 1 ]]; then
  "$tools_venv/bin/python" -m pip install -q build
  "$tools_venv/bin/python" -m build --sdist --outdir "$out" .
fi
ls -la "$out"
