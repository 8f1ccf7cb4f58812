/* Loads libflash_hopper.so and prints what its C ABI reports without a GPU, one JSON object:
 *   {"abi": N, "build_info": {...}, "has_fwd_bf16_d64_fa3": 0|1, "decode_stages_d128": N}
 * Built for the target (aarch64-linux-gnu-gcc) and run under qemu-aarch64 by
 * tools/check_wheel.py --arch aarch64: the cross-built library loads on an aarch64 glibc and
 * answers (the CUDA runtime starts lazily; none of these calls needs a device).
 *
 * Usage: abi_probe LIB */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

typedef int32_t (*abi_fn)(void);
typedef const char* (*info_fn)(void);
typedef int32_t (*has_fn)(int32_t, int32_t, int64_t);
typedef int32_t (*stages_fn)(int64_t, int32_t);

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s LIB\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "abi_probe: dlopen: %s\n", dlerror());
    return 1;
  }
  abi_fn abi = (abi_fn)dlsym(lib, "fh_abi_version");
  info_fn info = (info_fn)dlsym(lib, "fh_build_info");
  has_fn has = (has_fn)dlsym(lib, "fh_has_fwd_kernel");
  stages_fn stages = (stages_fn)dlsym(lib, "fh_decode_stages");
  if (abi == NULL || info == NULL || has == NULL || stages == NULL) {
    fprintf(stderr, "abi_probe: a C ABI symbol is missing: %s\n", dlerror());
    return 1;
  }
  /* FH_BACKEND_FA3 = 2, FH_DTYPE_BF16 = 1 (api.h); 227 KB of shared memory per block */
  printf("{\"abi\": %d, \"build_info\": %s, \"has_fwd_bf16_d64_fa3\": %d, "
         "\"decode_stages_d128\": %d}\n",
         abi(), info(), has(2, 1, 64), stages(128, 232448));
  return 0;
}
