#!/usr/bin/env bash
# Assemble nvcc's aarch64 ("sbsa") target folder for a cross build: the toolkit's own headers
# (architecture-independent) and the static CUDA runtime of NVIDIA's aarch64 runtime wheel of the
# toolkit's release (pip download: nothing installed). Prints two lines for the caller:
# FH_CUDA_TARGET_DIR=<folder> and FH_CUDA_TOOLKIT_TOP=<toolkit root>.
#
# Usage: tools/aarch64/cuda_target.sh [--nvcc NVCC] [--out DIR]
set -euo pipefail
nvcc="$(command -v nvcc || true)"
out="build/cuda-sbsa"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nvcc) nvcc="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "cuda_target: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -x "$nvcc" ]] || { echo "cuda_target: no nvcc ('$nvcc')" >&2; exit 1; }
# nvcc's own idea of its root (a wrapper script on PATH may point elsewhere): its dry run prints TOP
top="$("$nvcc" --dryrun -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=\(.*\)$/\1/p' | head -n 1)"
top="$(cd "$top" && pwd -P)"
release="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
major="${release%%.*}"
# NVIDIA's layout (targets/x86_64-linux/include), or a flat one (tools/cuda12_toolkit.sh's include/)
host_include=""
for dir in "$top/targets/x86_64-linux/include" "$top/include"; do
  if [[ -f "$dir/cuda_runtime.h" ]]; then host_include="$(cd "$dir" && pwd -P)"; break; fi
done
[[ -n "$host_include" ]] || { echo "cuda_target: no cuda_runtime.h under $top" >&2; exit 1; }
# the runtime of the toolkit's own release: nvlink refuses a device runtime newer than itself
case "$major" in
  12) wheel_req="nvidia-cuda-runtime-cu12==$release.*"; libdir="nvidia/cuda_runtime/lib" ;;
  13) wheel_req="nvidia-cuda-runtime==$release.*"; libdir="nvidia/cu13/lib" ;;
  *) echo "cuda_target: CUDA $major is not supported (12 or 13)" >&2; exit 1 ;;
esac
mkdir -p "$out"
out="$(cd "$out" && pwd -P)"
if [[ "$(cat "$out/RELEASE" 2>/dev/null)" != "$release" ]]; then
  rm -rf "$out/lib"
  tmp="$(mktemp -d)"
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_aarch64 \
    --platform manylinux_2_28_aarch64 "$wheel_req" -d "$tmp" >&2
  python3 -m zipfile -e "$tmp"/*.whl "$tmp/x"
  if [[ ! -f "$tmp/x/$libdir/libcudart_static.a" ]]; then
    # NVIDIA's aarch64 runtime wheels carry the static runtime from 12.9 on only; a 12.4 toolkit's
    # nvlink refuses 12.9's device runtime (tools/cuda12_toolkit.sh's release needs Debian's
    # arm64 nvidia-cuda-dev instead: not done yet)
    echo "cuda_target: $wheel_req for aarch64 has no libcudart_static.a" >&2
    exit 1
  fi
  mkdir -p "$out/lib"
  cp "$tmp/x/$libdir"/*.a "$out/lib/"
  # FindCUDAToolkit looks for the shared runtime as well (the library links the static one)
  cp "$tmp/x/$libdir"/libcudart.so.* "$out/lib/"
  ln -sfn "$(cd "$out/lib" && ls libcudart.so.* | head -n 1)" "$out/lib/libcudart.so"
  rm -rf "$tmp"
  echo "$release" > "$out/RELEASE"
fi
ln -sfn "$host_include" "$out/include"
echo "FH_CUDA_TARGET_DIR=$out"
echo "FH_CUDA_TOOLKIT_TOP=$top"
