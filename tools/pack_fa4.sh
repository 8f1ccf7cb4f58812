#!/usr/bin/env bash
# Pack FA4 (flash_attn.cute, the CuTe DSL FlashAttention) for a GPU machine without internet:
# one tarball that fits the device tool's 64 MiB carry next to the repository (~8.6 MB) and a
# small library (the versions measured: bench/PERFLOG.md "where a short decode
# call's time goes").
#
#   tools/pack_fa4.sh OUT.tar.xz        # ~57 MB; takes ~8 minutes on 2 cores (xz -9e, one thread)
#
# On the GPU machine:
#   tar -C /tmp -xJf OUT.tar.xz
#   PYTHONPATH=$PYTHONPATH:/tmp/fa4t:/tmp/fa4t/nvidia_cutlass_dsl/dsl_packages \
#     python -m flash_hopper.cli decode --page-size 16 --backends ... flash-attn-cute-paged
# (the package's .pth file is not read from a --target folder, hence the second path).
#
# What makes it fit: wheels for CPython 3.12 / manylinux_2_28 installed with `pip install
# --target` (no dependency resolution: the versions below are the set that imports together),
# __pycache__ and tvm_ffi's C++ headers dropped (not read at run time; libtvm_ffi_testing.so IS
# loaded at import: keep it), and xz with the x86 branch filter and a 256 MiB dictionary over the
# whole tree (the MLIR library is 193 MB of x86 code): 57 MB where plain `xz -9e -T2` gave 69.
set -euo pipefail
out="${1:?usage: tools/pack_fa4.sh OUT.tar.xz}"
out="$(realpath -m "$out")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

wheels=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)
target=(--python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: --no-deps)
python3 -m pip download -q -d "$work/wheels" "${target[@]}" "${wheels[@]}"
python3 -m pip install -q --target "$work/fa4t" "${target[@]}" "$work"/wheels/*.whl
find "$work/fa4t" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$work/fa4t/tvm_ffi/include" "$work/fa4t/tvm_ffi/3rdparty"
tar -C "$work" -cf - fa4t | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > "$out"
ls -l "$out"
