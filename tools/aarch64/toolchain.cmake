# Cross-compiling flash-hopper for aarch64 Linux (Grace-Hopper hosts) on an x86_64 machine.
#
# The GPU code does not change (the same sm_80 / sm_90a SASS); only the host side does: nvcc's
# host compiler is Debian's aarch64-linux-gnu-g++, and nvcc's target folder (headers, the static
# CUDA runtime) is FH_CUDA_TARGET_DIR, which tools/aarch64/cuda_target.sh assembles from the
# toolkit's headers and NVIDIA's aarch64 runtime wheel: nvcc takes it as
# --target-directory, a path relative to the toolkit's targets/ folder.
#
#   cmake -S . -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=tools/aarch64/toolchain.cmake \
#         -DFH_CUDA_TARGET_DIR=<folder> [-DCMAKE_CUDA_COMPILER=<nvcc>]
# (tools/build_wheels.sh --arch aarch64 does this through pip.)
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CUDA_HOST_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# The toolchain file runs again for every try_compile: the cache variables reach them this way.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES FH_CUDA_TARGET_DIR FH_CUDA_TOOLKIT_TOP)
if(NOT FH_CUDA_TARGET_DIR)
  set(FH_CUDA_TARGET_DIR "$ENV{FH_CUDA_TARGET_DIR}")
endif()
if(NOT FH_CUDA_TOOLKIT_TOP)
  set(FH_CUDA_TOOLKIT_TOP "$ENV{FH_CUDA_TOOLKIT_TOP}")
endif()
if(NOT FH_CUDA_TARGET_DIR OR NOT FH_CUDA_TOOLKIT_TOP)
  message(FATAL_ERROR "aarch64 toolchain: set FH_CUDA_TARGET_DIR (tools/aarch64/cuda_target.sh "
                      "prints it) and FH_CUDA_TOOLKIT_TOP (the toolkit root nvcc reports as TOP)")
endif()
file(RELATIVE_PATH _fh_rel "${FH_CUDA_TOOLKIT_TOP}/targets" "${FH_CUDA_TARGET_DIR}")
# A toolkit laid out flat (tools/cuda12_toolkit.sh: include/, lib64/) has no target folders in its
# nvcc.profile: there the aarch64 runtime is found through -L (GNU ld skips the x86_64 archives
# of the toolkit's own -L), nvcc's links (CMake's compiler check among them) and the host's.
set(CMAKE_CUDA_FLAGS_INIT "--target-directory ${_fh_rel} -L${FH_CUDA_TARGET_DIR}/lib")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "-L${FH_CUDA_TARGET_DIR}/lib")
set(CMAKE_EXE_LINKER_FLAGS_INIT "-L${FH_CUDA_TARGET_DIR}/lib")
set(CUDAToolkit_TARGET_DIR "${FH_CUDA_TARGET_DIR}")
set(CMAKE_FIND_ROOT_PATH "/usr/aarch64-linux-gnu" "${FH_CUDA_TARGET_DIR}")
