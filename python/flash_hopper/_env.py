"""The environment variables flash-hopper reads: every knob of the package, and the library's.

Every run-time knob is named FLASH_HOPPER_* (LOCAL_RANK is torchrun's). Read by the Python package
(through the functions below, at every call that needs them, so a test or a benchmark may change
one between calls):

============================= ====================================================== ===========
variable                      meaning                                                default
============================= ====================================================== ===========
FLASH_HOPPER_LIB              the library: a file, or a directory holding            unset
                              libflash_hopper.so, tried before the package's own
                              and the installed one (_lib.py); a path with no
                              library is an error, not a fallback
FLASH_HOPPER_DECODE           the decode kernel's routes: "0" none (the FA paths     "1"
                              run every call), "kvcache" flash_attn_with_kvcache
                              only, anything else also flash_attn_func's and
                              flash_attn_varlen_func's short queries
FLASH_HOPPER_CHECK_OFFSETS    "0": calls do not copy offsets, lengths and indices    "1"
                              to the host to check them (as during CUDA graph
                              capture); an unchecked bad value gives wrong rows,
                              never an access outside the tensors
FLASH_HOPPER_DV_KERNEL        "0": inference calls whose v has a head dim of its own  "1"
                              are zero-padded as every other such call (_dv.py);
                              else they run the FA-3 kernel with V's own head dim
                              where the library has one for the pair
FLASH_HOPPER_DEBUG_SMEM_LIMIT shared memory per block (bytes) the routing assumes    unset: the
                              when below the device's opt-in limit (to run the       device's
                              configs of smaller GPUs on a large one); the library   limit
                              reads it, Python keys its cached answers with it
LOCAL_RANK                    the CUDA device of distributed.init_from_torchrun      the global
                              (torchrun sets it)                                     rank
============================= ====================================================== ===========

Read by the C library itself (kernels/src, kernels/sm90), listed here so the knobs are in one
table:

============================= ====================================================== ===========
variable                      meaning                                                default
============================= ====================================================== ===========
FLASH_HOPPER_BWD_DET_CHUNK    k > 0: the FA-3 backward's deterministic tile order    the order's
                              takes k consecutive key blocks of a kv head per chunk  rule
                              (sm90/bwd/launch.h, read once per process; for
                              measurements: masked calls, the shift order of full
                              masks unchanged)
FLASH_HOPPER_DEBUG_SMEM_LIMIT as above, for the library's tile and stage choices     unset
                              and its policy's decode answers (device.cu
                              smem_limit, per call)
FLASH_HOPPER_DECODE_STAGES    the decode kernel's K / V pipeline stages, when the    per head
                              count is compiled (every one of tables.cmake's         dim
                              FH_DECODE_STAGE_COUNTS with the build option
                              FH_DECODE_EVERY_STAGE_COUNT) and fits (decode.cu)
FLASH_HOPPER_DECODE_PDL       "0": no programmatic dependent launch for the decode   on (sm_90)
                              kernel (decode.cu, for measurements)
FLASH_HOPPER_DECODE_PAIR      "0": a decode CTA per row block, never one over two    on (d <= 128)
                              (decode.cu decode_row_tiles, for measurements)
FLASH_HOPPER_FA3_MULTICAST    "0": unmasked FA-3 forward calls stay on the default   on
                              tile in a build with the K / V multicast kernels
                              (sm90/fwd/launch.h, read once per process)
============================= ====================================================== ===========

Read by the test suite (tests/) and set by the check scripts (.ci/run, bench/*.sh):

============================= ====================================================== ===========
variable                      meaning                                                default
============================= ====================================================== ===========
FLASH_HOPPER_REQUIRE_LIB      anything but "0": a missing library fails the tests    unset
                              that need it instead of skipping them, and the
                              library must be the build the FH_* variables ask for
                              (test_lib.py)
============================= ====================================================== ===========

Build options (FH_ARCHS, FH_DTYPES, FH_HEAD_DIMS, FH_FA3_MULTICAST, ...) are CMake's, named FH_*
and read at build time only.
"""

from __future__ import annotations

import os

LIBRARY = "FLASH_HOPPER_LIB"
DECODE = "FLASH_HOPPER_DECODE"
CHECK_OFFSETS = "FLASH_HOPPER_CHECK_OFFSETS"
DEBUG_SMEM_LIMIT = "FLASH_HOPPER_DEBUG_SMEM_LIMIT"
DV_KERNEL = "FLASH_HOPPER_DV_KERNEL"
LOCAL_RANK = "LOCAL_RANK"


def library_path() -> str:
    """FLASH_HOPPER_LIB, stripped ("" when unset or blank)."""
    return os.environ.get(LIBRARY, "").strip()


def decode_mode() -> str:
    """FLASH_HOPPER_DECODE as given ("1" when unset)."""
    return os.environ.get(DECODE, "1")


def offsets_check_on() -> bool:
    """False only for FLASH_HOPPER_CHECK_OFFSETS=0."""
    return os.environ.get(CHECK_OFFSETS, "1") != "0"


def dv_kernel_on() -> bool:
    """Whether inference calls may run the kernel with V's own head dim: False only for
    FLASH_HOPPER_DV_KERNEL=0 (the padded path, for comparisons)."""
    return os.environ.get(DV_KERNEL, "1") != "0"


def debug_smem_limit() -> int:
    """FLASH_HOPPER_DEBUG_SMEM_LIMIT in bytes, 0 when unset or not an integer (no limit of its
    own)."""
    value = os.environ.get(DEBUG_SMEM_LIMIT, "")
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def local_rank(default: int) -> int:
    """LOCAL_RANK as an int, ``default`` when unset."""
    return int(os.environ.get(LOCAL_RANK, default))
