# The build's tables, once on the C side: directions, head-dim buckets, dtypes, the FA-3 path's
# variants and the decode kernel's head dims, stages and dtypes.
#
# CMakeLists.txt turns them into the instantiation list (one generated .cu per kernel), the
# launcher registry (fh_registry.inc), the C ABI's constants and messages, and fh_build_info()'s
# JSON (fh_tables.inc; the decode kernel's in fh_decode_table.inc, which its translation unit
# includes). Python keeps its own copy in python/flash_hopper/_tables.py (derived from the api.h
# enum mirror, so torch.compile can trace validation without loading the library);
# tests/test_lib.py checks that copy against api.h and against the built library's build_info,
# and the library refuses to load when they disagree. The decode kernel's table Python reads from
# build_info: which calls it serves is the library's policy's answer, never Python's.

# Directions: FH_DIRECTIONS value | the fh_registry.inc row macro of its launchers | the FH_ARCHS
# paths that implement it (comma-separated). A direction's instantiations come from
# kernels/src/<direction>_<arch>_inst.cu.in; "bwd" also builds kernels/src/bwd_common.cu once (the
# preprocess both paths share). The FA-3 path's backward covers the buckets CMakeLists.txt lists
# in FH_SM90_BWD_HEAD_DIMS (kernels/sm90/bwd/tile_config.h).
set(FH_DIRECTION_TABLE
  "fwd|FH_REGISTER_FWD|80,90a"
  "bwd|FH_REGISTER_BWD|80,90a")

# Kernel paths: FH_ARCHS value | arch name (build_info "archs") | FhBackend enumerator (api.h).
# "80" builds the FA-2 path (SASS for sm80 and sm90, PTX for later GPUs); "90a" the FA-3 path.
set(FH_ARCH_TABLE
  "80|sm80|FH_BACKEND_FA2"
  "90a|sm90a|FH_BACKEND_FA3")

# Head-dim buckets: a kernel serves every head_dim % 8 == 0 up to its bucket (TMA / predicated
# loads zero-fill the columns above head_dim). Ascending; the last one is the largest head_dim.
set(FH_HEAD_DIM_TABLE 64 96 128 192 256)

# Input dtypes that have kernels: name (FH_DTYPES, build_info) | FhDtype enumerator (api.h) |
# CUTLASS element type of the instantiation | the direction:path pairs that have kernels for it
# ("all": every direction on every path) | the head-dim buckets it has kernels for ("all": every
# bucket). FP8 (e4m3) is the FA-3 path's forward only, in the buckets with an FP8 tile
# (kernels/sm90/fwd/tile_config.h, has_fp8_config).
set(FH_DTYPE_TABLE
  "fp16|FH_DTYPE_FP16|cutlass::half_t|all|all"
  "bf16|FH_DTYPE_BF16|cutlass::bfloat16_t|all|all"
  "e4m3|FH_DTYPE_E4M3|cutlass::float_e4m3_t|fwd:90a|64,96,128,192,256")

# Mixed mode (docs/fwd_sm90.md "Mixed mode"): fp16 / bf16 q against an FP8 K / V cache, the FA-3
# path's forward only.
# Name (FH_DTYPES, build_info) | q's FhDtype | K / V's FhDtype (api.h, FhFwdParams::kv_dtype) |
# q's CUTLASS type | K / V's CUTLASS type | head-dim buckets (kernels/sm90/fwd/tile_config.h,
# has_mixed_config). Its kernels have the names of FH_DTYPES too, so a build selects them like
# any dtype.
set(FH_MIXED_TABLE
  "bf16+e4m3|FH_DTYPE_BF16|FH_DTYPE_E4M3|cutlass::bfloat16_t|cutlass::float_e4m3_t|64,128,256"
  "fp16+e4m3|FH_DTYPE_FP16|FH_DTYPE_E4M3|cutlass::half_t|cutlass::float_e4m3_t|64,128,256"
  "bf16+e5m2|FH_DTYPE_BF16|FH_DTYPE_E5M2|cutlass::bfloat16_t|cutlass::float_e5m2_t|64,128,256"
  "fp16+e5m2|FH_DTYPE_FP16|FH_DTYPE_E5M2|cutlass::half_t|cutlass::float_e5m2_t|64,128,256")

# A V head dim of its own (FA3's dv != d): head-dim bucket | V head-dim bucket, the FA-3 path's
# forward kernels whose V, PV GEMM and O are the second wide (kernels/sm90/fwd/tile_config.h,
# has_dv_config): a call with head_dim in the first bucket and head_dim_v in the second runs
# there. Built for the 16-bit dtypes of FH_DTYPES wherever the head-dim bucket is in FH_HEAD_DIMS;
# other pairs are zero-padded by Python (python/flash_hopper/_dv.py).
set(FH_HEAD_DIM_V_TABLE
  "192|128")

# Variants of the FA-3 path (the FA3 paper's ablation): backend name | FhVariant value | the
# variant whose kernel serves it. A value is a set of api.h's FH_VARIANT_FLAG_* bits; the name is
# "fa3" plus "-<flag>" per set bit in bit order (Python derives the same names from the enum).
# - NO_PINGPONG (1) is a runtime switch (kernel argument), so the kernel without it serves it.
# - NO_OVERLAP (2) is a template parameter (kOverlap), so it needs a kernel of its own; those
#   kernels are built only for FH_FA3_ABLATION_DTYPES x FH_FA3_ABLATION_HEAD_DIMS.
# Row i must have value i (tables.h indexes the names by value, and static_asserts the count).
set(FH_FA3_VARIANT_TABLE
  "fa3|0|0"
  "fa3-no-pingpong|1|0"
  "fa3-no-overlap|2|2"
  "fa3-no-pingpong-no-overlap|3|2")

# The decode kernel (kernels/decode/decode_kernel.h, docs/decode.md), in every build whatever the
# FH_* variables select (its kernels are small). Head dims: head dim | the key-ring stages it runs
# at with a 16-bit cache where they fit the device | the same with an FP8 cache (kernels/src/
# decode.cu says why each), ascending. A head dim must be a multiple of 64 (the kernel's
# shared-memory swizzle).
set(FH_DECODE_TABLE
  "64|4|5"
  "128|3|5"
  "256|3|5")
# The stage counts per head dim: a device with less shared memory per block runs the largest one
# that fits. Compiled are those a known GPU runs (kernels/src/decode.cu), or all that fit 227 KiB
# with FH_DECODE_EVERY_STAGE_COUNT, so that FLASH_HOPPER_DECODE_STAGES can measure the others.
# Ascending; the first is the fewest a device must hold for the kernel to serve it.
set(FH_DECODE_STAGE_COUNTS 2 3 4 5)
# Its inputs: FH_DTYPE_TABLE names (q, K and V alike; e4m3 is FA3's FP8 convention, q, K and V in
# e4m3 with descales and a bf16 output) and FH_MIXED_TABLE names (16-bit q against an FP8 cache,
# o in q's dtype); the FP8 caches are widened to 16 bits in registers, the MMAs stay 16-bit.
# And the packed rows (query tokens x query heads per KV head) of the calls the library's policy
# sends to it (kernels/src/policy.cu): each 16 rows re-read the keys from L2, so longer queries
# stay on the FA kernels.
set(FH_DECODE_DTYPES fp16 bf16 e4m3 bf16+e4m3 fp16+e4m3 bf16+e5m2 fp16+e5m2)
set(FH_DECODE_MAX_ROWS 128)
