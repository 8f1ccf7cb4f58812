"""flash-hopper: FlashAttention-3-class attention kernels for Hopper, with an Ampere path.

Importing needs no GPU and no kernel library: the library is loaded on the first call that needs
it (see _lib.py for where it is looked for).
"""

from __future__ import annotations

from typing import Any

from . import _lib, fp8
from ._combine import flash_attn_combine
from ._errors import (
    CudaError,
    DeviceQueryError,
    InternalError,
    LibraryNotFoundError,
    UnsupportedError,
)
from .dispatch import supports
from .interface import (
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    which_backend,
)
from .kvcache import flash_attn_with_kvcache, get_scheduler_metadata

__version__ = _lib.installed_version() or "0+unknown"  # unknown: a source tree never installed


def build_info() -> dict[str, Any]:
    """The library's build description: what was compiled ("kernels": one {backend, dtype,
    head_dim, variants} entry per kernel; "archs", "head_dims", "dtypes" as sets; "fa3_variants",
    the ablation backends it serves), the tables it was built with ("head_dim_buckets",
    "variants": FA-3 variant name -> FhVariant value) and version, commit, cuda.

    Raises LibraryNotFoundError when the library cannot be loaded.
    """
    return _lib.get_library().build_info()


def library_path() -> str | None:
    """Path of the kernel library that is (or would be) loaded, or None if none is found."""
    path = _lib.loaded_path() or _lib.find_library()
    return str(path) if path is not None else None


__all__ = [
    "CudaError",
    "DeviceQueryError",
    "InternalError",
    "LibraryNotFoundError",
    "UnsupportedError",
    "__version__",
    "build_info",
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "fp8",
    "get_scheduler_metadata",
    "library_path",
    "supports",
    "which_backend",
]
