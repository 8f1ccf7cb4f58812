"""The C side's tables, once on the Python side: head-dim buckets, dtypes, backend names, archs.

The C side defines them once too: api.h's enums and kernels/src/tables.cmake, from which CMake
generates the instantiations, the registry and fh_build_info(). Here everything is derived from
the api.h enum mirror in _abi.py rather than read from the library at call time, so validation
stays traceable by torch.compile (no ctypes while tracing) and works on machines without the
kernels. Agreement is checked twice: tests/test_lib.py compares these tables with api.h and with
the built library's build_info, and loading a library whose tables differ fails
(``build_info_mismatch``), so a mismatch cannot go unnoticed at run time either.
"""

from __future__ import annotations

from typing import Any

import torch

from ._abi import FhBackend, FhDtype, FhVariant, FhVariantFlag

# --- head dims -----------------------------------------------------------------------------------

# Kernels exist per bucket; a head_dim % 8 == 0 runs in the smallest bucket >= head_dim.
HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)
HEAD_DIM_MULTIPLE = 8  # 16-byte rows of 2-byte elements
MIN_HEAD_DIM = HEAD_DIM_MULTIPLE
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]


def head_dim_bucket(head_dim: int) -> int:
    """Smallest head-dim bucket >= head_dim (a kernel pads d up to its bucket)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim: expected at most {MAX_HEAD_DIM}, got {head_dim}")


# --- dtypes: torch.dtype <-> FhDtype <-> name ("bf16", as FH_DTYPES and build_info spell it) ------

TORCH_DTYPES = {torch.float16: FhDtype.FP16, torch.bfloat16: FhDtype.BF16}
# FP8 inputs: the FA-3 path's forward only (kernels/src/tables.cmake); o is fp16 or bf16.
FP8_DTYPES = {torch.float8_e4m3fn: FhDtype.E4M3}
INPUT_DTYPES = {**TORCH_DTYPES, **FP8_DTYPES}
# The mixed mode (fp16 / bf16 q against an FP8 K / V cache, the FA-3 path's forward): K / V
# dtypes (FhFwdParams.kv_dtype), and the FH_DTYPES / build_info names of its kernels
# (kernels/src/tables.cmake, FH_MIXED_TABLE) -> (q dtype, K / V dtype).
KV_FP8_DTYPES = {torch.float8_e4m3fn: FhDtype.E4M3, torch.float8_e5m2: FhDtype.E5M2}
MIXED_DTYPES = {
    f"{FhDtype(TORCH_DTYPES[q]).name.lower()}+{FhDtype(kv_code).name.lower()}": (q, kv)
    for kv, kv_code in KV_FP8_DTYPES.items() for q in (torch.bfloat16, torch.float16)
}
MIXED_HEAD_DIM_BUCKETS = (64, 128, 256)
FP8_HEAD_DIM_MULTIPLE = 16  # 16-byte rows of 1-byte elements
# The FP8 single-level accumulation ablation: the d192 / d256 kernels split their PV accumulator
# over the head dim and accumulate in two levels only (kernels/sm90/fwd/tile_config.h).
FP8_SINGLE_LEVEL_MAX_HEAD_DIM = 128


def dtype_name(dtype: FhDtype | torch.dtype) -> str:
    """'fp16' / 'bf16' / 'e4m3' for an FhDtype or a supported torch dtype (the enum name, lower
    case)."""
    return FhDtype(INPUT_DTYPES.get(dtype, dtype)).name.lower()


DTYPE_NAMES = {dtype_name(d): d for d in INPUT_DTYPES}  # "bf16" -> torch.bfloat16

# --- dtype arguments: the forms users pass, to one name ------------------------------------------

# One element's spellings -> its name: "bf16", torch.bfloat16, "bfloat16", "torch.bfloat16". Every
# spelling is derived from the torch dtypes above; e5m2 is a K / V element of the mixed mode only.
_ELEMENT_SPELLINGS: dict[Any, str] = {
    spelling: FhDtype(code).name.lower()
    for torch_dtype, code in {**INPUT_DTYPES, **KV_FP8_DTYPES}.items()
    for spelling in (FhDtype(code).name.lower(), torch_dtype, str(torch_dtype),
                     str(torch_dtype).removeprefix("torch."))
}


def _element(value: Any) -> str | None:
    """The name of one element dtype in any of its spellings, or None."""
    if isinstance(value, str):
        value = value.strip().lower()
    try:
        return _ELEMENT_SPELLINGS.get(value)
    except TypeError:  # unhashable: no dtype
        return None


def canonical_dtype(value: Any, arg: str = "dtype") -> str:
    """The FH_DTYPES name ("fp16", "bf16", "e4m3" or a mixed "bf16+e4m3") of a user's dtype
    argument, which may be such a name, a torch dtype (torch.bfloat16, torch.float8_e4m3fn), torch's
    spelling of one ("bfloat16", "torch.bfloat16"), or for the mixed mode (16-bit q against FP8 K /
    V) a (q dtype, K / V dtype) pair of those, such as (torch.bfloat16, torch.float8_e4m3fn), or a
    "q+kv" string of them ("bfloat16+float8_e5m2"). A pair of equal dtypes is that dtype.
    ValueError, naming ``arg``, the accepted forms and the value, for anything else."""
    if isinstance(value, str) and "+" in value:
        parts = value.split("+")
    elif isinstance(value, (tuple, list)):
        parts = list(value)
    else:
        parts = [value]
    names = [_element(p) for p in parts]
    name = None
    if len(names) == 2 and None not in names:
        name = names[0] if names[0] == names[1] else "+".join(names)
    elif len(names) == 1 and parts[0] is value:
        name = names[0]
    if name in DTYPE_NAMES or name in MIXED_DTYPES:
        return name
    raise ValueError(
        f"{arg}: expected one of {', '.join((*DTYPE_NAMES, *MIXED_DTYPES))}, a torch dtype "
        f"({', '.join(str(d) for d in INPUT_DTYPES)}; also spelled \"bfloat16\" or "
        f"\"torch.bfloat16\") or, for the mixed mode, a (q dtype, K / V dtype) pair such as "
        f"(torch.bfloat16, torch.float8_e4m3fn) or \"bf16+e5m2\", got {value!r}")


def kv_fp8_dtype(value: Any, arg: str = "dtype") -> torch.dtype:
    """The torch dtype of an FP8 K / V element of the mixed mode in any spelling ("e5m2",
    torch.float8_e5m2, "float8_e5m2", "torch.float8_e5m2"); ValueError naming ``arg`` otherwise."""
    name = _element(value)
    for torch_dtype in KV_FP8_DTYPES:
        if name == _element(torch_dtype):
            return torch_dtype
    forms = [*(_element(d) for d in KV_FP8_DTYPES), *(str(d) for d in KV_FP8_DTYPES)]
    raise ValueError(f"{arg}: expected an FP8 K / V dtype, one of {', '.join(forms)}, got "
                     f"{value!r}")

# --- kernel paths and archs ----------------------------------------------------------------------

# Per path: the FH_ARCHS value that builds it and build_info's arch name.
ARCHS = {FhBackend.FA2: ("80", "sm80"), FhBackend.FA3: ("90a", "sm90a")}


def arch_backend(arch: str) -> FhBackend | None:
    """The path an arch spelling builds ('sm90a', 'sm_90a', '90a', '80', ...), or None."""
    digits = str(arch).lower().replace("sm_", "").replace("sm", "")
    for backend, (value, _name) in ARCHS.items():
        if digits == value:
            return backend
    return None


# --- backend names: "auto", "fa2", "fa3" and the FA-3 variants -----------------------------------


def variant_name(variant: int) -> str:
    """'fa3' plus '-<flag>' per set FhVariantFlag bit, in bit order (api.h's naming rule;
    kernels/src/tables.cmake spells the same names): 3 -> 'fa3-no-pingpong-no-overlap'."""
    flags = [f.name.lower().replace("_", "-") for f in FhVariantFlag if variant & f]
    return "-".join(["fa3", *flags])


# name -> (FhBackend, FhVariant) of the request; the order is the one messages list them in.
BACKENDS: dict[str, tuple[FhBackend, FhVariant]] = {
    "auto": (FhBackend.AUTO, FhVariant.TUNED),
    "fa2": (FhBackend.FA2, FhVariant.TUNED),
    **{variant_name(v): (FhBackend.FA3, v) for v in FhVariant},
}
BACKEND_NAMES = tuple(BACKENDS)
FA3_VARIANT_NAMES = {variant_name(v): v for v in FhVariant}  # "fa3" included (variant 0)
_RUNNING_NAMES = {
    **{(int(FhBackend.FA3), int(v)): name for name, v in FA3_VARIANT_NAMES.items()},
    **{(int(b), 0): b.name.lower() for b in FhBackend if b != FhBackend.FA3},
}


def backend_name(backend: int, variant: int = FhVariant.TUNED) -> str:
    """The name of what runs: 'fa2', or the FA-3 variant's name ('fa3', 'fa3-no-pingpong', ...)."""
    return _RUNNING_NAMES[int(backend), int(variant) if backend == FhBackend.FA3 else 0]


# --- build_info's kernel list, by direction -----------------------------------------------------

DIRECTIONS = ("fwd", "bwd")


def kernel_entries(info: dict[str, Any], direction: str = "fwd") -> list[dict[str, Any]]:
    """build_info's "kernels" entries of one direction. Libraries before ABI 3 list forward
    kernels only and have no "direction" key: an entry without one is a forward kernel."""
    return [k for k in info.get("kernels") or () if k.get("direction", "fwd") == direction]


def has_backward(info: dict[str, Any]) -> bool:
    """Whether a build holds backward kernels (build_info "backward"; False before ABI 3)."""
    return bool(info.get("backward", False))


# --- the decode kernel's table (build_info "decode": kernels/src/tables.cmake) -------------------


def decode_table(info: dict[str, Any]) -> dict[str, Any]:
    """build_info's "decode": the decode kernel's dtypes (FH_DTYPES names, mixed ones for 16-bit
    q against an FP8 cache), head_dims with their tuned stages (fp8_stages: with an FP8 cache), the
    table's stage_counts (every_stage_count: all compiled, else those a known GPU runs) and max_rows (the packed rows of the calls the policy sends to it); {}
    for a library before ABI 11. Which calls it serves is the library's policy's answer
    (dispatch.choose, fh_decode_select_backend): this is for reports and messages."""
    return dict(info.get("decode") or {})


def decode_summary(info: dict[str, Any]) -> str:
    """What the decode kernel takes, as messages say it: "fp16 / bf16, head_dim 64 / 128 / 256,
    seqlen_q * heads_q / heads_kv <= 128"."""
    table = decode_table(info)
    return (f"{' / '.join(table.get('dtypes', ()))}, head_dim "
            f"{' / '.join(str(d) for d in table.get('head_dims', ()))}, seqlen_q * heads_q / "
            f"heads_kv <= {table.get('max_rows', '?')}")


# --- agreement with a built library --------------------------------------------------------------


def build_info_mismatch(info: dict[str, Any]) -> str | None:
    """Why a library's build_info disagrees with these tables, or None when it agrees."""
    variants = {name: FhVariant(v) for name, v in FA3_VARIANT_NAMES.items()}
    if info.get("variants") != {name: int(v) for name, v in variants.items()}:
        return f"its FA-3 variants are {info.get('variants')}, this package has {variants}"
    if tuple(info.get("head_dim_buckets", ())) != HEAD_DIM_BUCKETS:
        return (f"its head-dim buckets are {info.get('head_dim_buckets')}, this package has "
                f"{HEAD_DIM_BUCKETS}")
    unknown = [d for d in info.get("dtypes", ()) if d not in DTYPE_NAMES and d not in MIXED_DTYPES]
    if unknown:
        return f"it has kernels for dtypes {unknown} this package does not know"
    return None
