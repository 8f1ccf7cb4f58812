#!/usr/bin/env bash
# Assemble a CUDA 12 toolkit (nvcc, cicc, ptxas, headers, the static runtime) in one folder, laid
# out like NVIDIA's installer lays it out, for building the cu12 flavour of the wheels
# (tools/build_wheels.sh --flavour cu12) on a machine whose own toolkit is CUDA 13.
#
# Why from Debian's archive: the CUDA 12 wheels on PyPI do not hold a compiler. The nvcc wheel
# (nvidia-cuda-nvcc-cu12, 12.0 ... 12.9) carries ptxas and libnvvm only (no nvcc driver, cicc or
# cudafe++), and the runtime wheel (nvidia-cuda-runtime-cu12) carries libcudart.so.12 but no
# libcudart_static.a. Debian's non-free section packages NVIDIA's CUDA 12 toolkit whole:
# nvidia-cuda-toolkit (compiler) and nvidia-cuda-dev (headers, libcudart_static.a). Nothing is
# installed system-wide: apt runs with its own lists and cache under --work, the packages are
# unpacked with dpkg-deb, and only what the build needs is copied to --prefix. CCCL (libcu++,
# CUB, Thrust: CUTLASS includes cuda/std) comes from the nvidia-cuda-cccl-cu12 wheel of the same
# release.
#
# ptxas comes from a newer CUDA 12 than the rest: the nvidia-cuda-nvcc-cu12 wheel of --ptxas
# (12.9) does carry ptxas, and the FA-3 kernels need it. 12.4's ptxas schedules them with 200-300
# more instructions each (MOV / ISETP / DEPBAR) and they ran 10 % (d64), 1-2 % (d128) and 22-25 %
# (d256) slower on the H200 (bench/PERFLOG.md "Wheels: the cu12 flavour's ptxas"); 12.9's SASS
# matches CUDA 13.0's within 1 %. nvcc 12.4's front end (cicc) still writes the PTX, and SASS
# from any CUDA 12 ptxas loads on every CUDA 12 driver (>= 525.60.13, minor-version
# compatibility), so the driver floor stays.
#
# Usage: tools/cuda12_toolkit.sh --prefix DIR [--suite trixie] [--version 12.4.131~12.4.1-2]
#          [--cccl 12.4.127] [--ptxas 12.9.86] [--mirror URI] [--work DIR]
# Then:  CUDACXX=DIR/bin/nvcc pip wheel .   (or tools/build_wheels.sh --flavour cu12 --cuda12 DIR)
set -euo pipefail

prefix=""
suite="trixie"                   # Debian 13: CUDA 12.4.1, the newest CUDA 12 in a Debian release
version="12.4.131~12.4.1-2"      # nvidia-cuda-toolkit's version there (nvcc 12.4.131)
dev_version="12.4.127~12.4.1-2"  # nvidia-cuda-dev's (cudart 12.4.127)
cccl="12.4.127.post1"            # nvidia-cuda-cccl-cu12 of the same release (12.4.127 itself
                                 # is yanked: it lacks libcu++)
ptxas="12.9.86"                  # nvidia-cuda-nvcc-cu12 whose ptxas replaces 12.4's (above)
mirror=""
work=""

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --suite) suite="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --dev-version) dev_version="$2"; shift 2 ;;
    --cccl) cccl="$2"; shift 2 ;;
    --ptxas) ptxas="$2"; shift 2 ;;
    --mirror) mirror="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "cuda12_toolkit: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$prefix" ]] || { echo "cuda12_toolkit: --prefix DIR is required" >&2; exit 2; }
prefix="$(mkdir -p "$prefix" && cd "$prefix" && pwd)"
work="${work:-$prefix/.work}"
mkdir -p "$work"/unpacked

# The Debian archive this machine's apt already uses (or --mirror): the same registry, another
# suite / section.
"$(dirname "$0")/debian_download.sh" --work "$work" --suite "$suite" ${mirror:+--mirror "$mirror"} \
  "nvidia-cuda-toolkit=$version" "nvidia-cuda-dev=$dev_version" "libcudart12=$dev_version"

tk_deb="$(ls "$work"/debs/nvidia-cuda-toolkit_*.deb)"
dev_deb="$(ls "$work"/debs/nvidia-cuda-dev_*.deb)"
u="$work/unpacked"
dpkg-deb -x "$tk_deb" "$u"
dpkg-deb -x "$(ls "$work"/debs/libcudart12_*.deb)" "$u"
# nvidia-cuda-dev is ~2.5 GB unpacked (every CUDA library, static): take the headers and the
# three static libraries a CUDA runtime link uses.
dpkg-deb --fsys-tarfile "$dev_deb" | tar -x -C "$u" --wildcards \
  './usr/include/*' './usr/lib/x86_64-linux-gnu/libcudart_static.a' \
  './usr/lib/x86_64-linux-gnu/libcudadevrt.a' './usr/lib/x86_64-linux-gnu/libculibos.a'

rm -rf "$prefix"/{bin,nvvm,include,lib64}
mkdir -p "$prefix"/{bin/crt,nvvm/bin,nvvm/libdevice,include,lib64}
for tool in ptxas fatbinary cudafe++ nvlink bin2c cuobjdump nvdisasm nvprune cu++filt; do
  cp "$u/usr/bin/$tool" "$prefix/bin/"
done
cp "$u/usr/lib/nvidia-cuda-toolkit/bin/nvcc" "$prefix/bin/nvcc"  # /usr/bin/nvcc is a wrapper
cp "$u"/usr/lib/nvidia-cuda-toolkit/bin/crt/*.stub "$prefix/bin/crt/"
cp "$u/usr/lib/nvidia-cuda-toolkit/bin/cicc" "$prefix/nvvm/bin/"
cp "$u/usr/lib/nvidia-cuda-toolkit/libdevice/libdevice.10.bc" "$prefix/nvvm/libdevice/"
cp -r "$u"/usr/include/. "$prefix/include/"
cp "$u"/usr/lib/x86_64-linux-gnu/lib{cudart_static,cudadevrt,culibos}.a "$prefix/lib64/"
# CMake's FindCUDAToolkit insists on the shared runtime existing; the library links the static one.
cp "$u"/usr/lib/x86_64-linux-gnu/libcudart.so.12.* "$prefix/lib64/"
(cd "$prefix/lib64" && ln -sf libcudart.so.12.* libcudart.so.12 &&
  ln -sf libcudart.so.12 libcudart.so)
ln -sfn lib64 "$prefix/lib"

# Debian's profile points at /usr/lib/nvidia-cuda-toolkit; this one at the prefix, as NVIDIA's.
cat > "$prefix/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF

# CCCL of the same release from its wheel (pip download: no install, no dependencies).
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/cccl" \
  "nvidia-cuda-cccl-cu12==$cccl"
python3 - "$work"/cccl/nvidia_cuda_cccl_cu12-*.whl "$prefix/include" <<'EOF'
import os
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
root = "nvidia/cuda_cccl/include/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        rel = name[len(root):] if name.startswith(root) else ""
        if not rel or name.endswith("/") or rel == "__init__.py":
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        with z.open(name) as src, open(os.path.join(dest, rel), "wb") as out:
            out.write(src.read())
EOF

# ptxas of --ptxas from its wheel, in place of the toolkit's (see the header).
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/ptxas" \
  "nvidia-cuda-nvcc-cu12==$ptxas"
python3 - "$work"/ptxas/nvidia_cuda_nvcc_cu12-*.whl "$prefix/bin/ptxas" <<'EOF'
import os
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("nvidia/cuda_nvcc/bin/ptxas") as src:
    data = src.read()
with open(dest + ".new", "wb") as out:
    out.write(data)
os.chmod(dest + ".new", 0o755)
os.replace(dest + ".new", dest)
EOF
"$prefix/bin/ptxas" --version | tail -n 1

rm -rf "${u:?}"  # the unpacked packages; the downloaded .debs stay in --work for a re-run
"$prefix/bin/nvcc" --version | tail -n 2
test -f "$prefix/include/cuda/std/version" ||
  { echo "cuda12_toolkit: CCCL headers missing under $prefix/include" >&2; exit 1; }
echo "cuda12_toolkit: CUDA 12 toolkit in $prefix (CUDACXX=$prefix/bin/nvcc)"
