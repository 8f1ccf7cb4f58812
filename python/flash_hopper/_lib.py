"""ctypes binding of libflash_hopper.so, the kernels' C ABI (kernels/include/flash_hopper/api.h).

Why ctypes and not a torch extension: the library has no torch (or Python) symbols, so one binary
serves every torch and every Python version, and it can be built without either.

Loading is lazy: ``import flash_hopper`` works on a machine without the library (CPU-only tests,
the reference implementation, docs); the first call that needs a kernel loads it via
``get_library()``, which raises ``LibraryNotFoundError`` saying where it looked and how to build.

Search order: ``$FLASH_HOPPER_LIB`` (a file, or a directory holding libflash_hopper.so), then next
to this package (where the wheel installs it), then the file the installed distribution recorded
(an editable install). An explicit ``$FLASH_HOPPER_LIB`` that points at
nothing is an error rather than a silent fallback: the user asked for that file.

The installed distribution is ``flash-hopper`` (built from source) or one of the binary wheels'
``flash-hopper-cu13`` / ``flash-hopper-cu12`` (DISTRIBUTIONS): one import package, ``flash_hopper``,
whichever of them installed it.
"""

from __future__ import annotations

import ctypes
import json
import threading
from importlib.metadata import PackageNotFoundError, files, version
from pathlib import Path
from typing import Any

from . import _env

# The ABI's names, importable from here too (tests and bench/ import them from _lib).
from ._abi import (  # noqa: F401
    ABI_VERSION,
    FhBackend,
    FhBwdParams,
    FhDecodeParams,
    FhDtype,
    FhFp8Accumulation,
    FhFwdParams,
    FhStatus,
    FhVariant,
    FhVariantFlag,
)
from ._errors import CudaError, InternalError, LibraryNotFoundError, UnsupportedError

LIB_NAME = "libflash_hopper.so"
ENV_VAR = _env.LIBRARY


def candidate_paths() -> list[Path]:
    """Where the library is looked for, in order (see the module docstring)."""
    paths = []
    env = _env.library_path()
    if env:
        p = Path(env).expanduser()
        paths.append(p / LIB_NAME if p.is_dir() else p)
    paths.append(Path(__file__).resolve().parent / LIB_NAME)
    installed = _installed_library()
    if installed is not None and installed not in paths:
        paths.append(installed)
    return paths


# Distributions that install this package: the source build's name and the CUDA flavours of the
# binary wheels (tools/wheel_flavour.py renames a wheel to one of those), first match wins.
DISTRIBUTIONS = ("flash-hopper", "flash-hopper-cu13", "flash-hopper-cu12")


def installed_distribution() -> str | None:
    """The name of the installed distribution that provides flash_hopper, or None."""
    for name in DISTRIBUTIONS:
        try:
            version(name)
        except PackageNotFoundError:
            continue
        return name
    return None


def installed_version() -> str | None:
    """The installed distribution's version, or None for a source tree never installed."""
    name = installed_distribution()
    return version(name) if name is not None else None


def _installed_library() -> Path | None:
    """The copy the installed distribution recorded, wherever it went: an editable install
    (`pip install -e .`) imports the package from the source tree, but the built library lands
    in site-packages, so "next to this file" does not find it."""
    name = installed_distribution()
    if name is None:
        return None
    for f in files(name) or []:
        if f.name == LIB_NAME:
            return Path(str(f.locate())).resolve()
    return None


def find_library() -> Path | None:
    """The library file that would be loaded, or None when there is none."""
    env_set = bool(_env.library_path())
    for i, p in enumerate(candidate_paths()):
        if p.is_file():
            return p
        if i == 0 and env_set:
            return None  # an explicit $FLASH_HOPPER_LIB that points at nothing wins
    return None


def _not_found_message() -> str:
    looked = "\n".join(f"  - {p}" for p in candidate_paths())
    env = _env.library_path()
    hint_env = (
        f"${ENV_VAR} is set to {env!r} but no {LIB_NAME} is there.\n" if env else ""
    )
    return (
        f"flash-hopper's kernel library {LIB_NAME} was not found.\n{hint_env}Looked in:\n"
        f"{looked}\n"
        "Build it either by installing the package (`pip install .` builds it and puts it next "
        "to the package), or for development with CMake:\n"
        "  cmake -S . -B build/dev -G Ninja -DFH_ARCHS='80;90a' && cmake --build build/dev\n"
        f"  export {ENV_VAR}=$PWD/build/dev/{LIB_NAME}"
    )


class Library:
    """The loaded library with typed wrappers; one instance per process (see get_library).

    Loading checks the ABI version and that the library's tables (variant names, head-dim
    buckets: fh_build_info) are the ones this package derives (_tables.py): a library built from
    another checkout fails here instead of mislabelling kernels later.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self._dll = ctypes.CDLL(str(path))
        except OSError as e:
            raise LibraryNotFoundError(
                f"flash-hopper: {path} exists but could not be loaded: {e}\n"
                "(a missing libcuda.so.1 means no NVIDIA driver is installed)"
            ) from e
        try:
            self._bind()
        except AttributeError as e:
            raise LibraryNotFoundError(
                f"flash-hopper: {path} lacks a C ABI symbol ({e}); it is not a flash-hopper "
                "library or is from an incompatible version; rebuild it"
            ) from e
        self._has_kernel: dict[tuple[int, int, int], bool] = {}
        self._has_bwd_kernel: dict[tuple[int, int, int], bool] = {}
        self.abi_version = int(self._dll.fh_abi_version())
        if self.abi_version != ABI_VERSION:
            raise LibraryNotFoundError(
                f"flash-hopper: {path} has C ABI version {self.abi_version}, this Python package "
                f"expects {ABI_VERSION}; rebuild the library from the same checkout as the package"
            )
        from . import _tables  # here, not at the top: _tables imports torch, loading does not

        mismatch = _tables.build_info_mismatch(self.build_info())
        if mismatch:
            raise LibraryNotFoundError(
                f"flash-hopper: {path} does not match this Python package: {mismatch}; rebuild "
                "the library from the same checkout as the package"
            )
        # The launch entry points themselves: the host paths call them without a wrapper frame.
        self.fh_fwd = self._dll.fh_fwd
        self.fh_bwd = self._dll.fh_bwd

    def _bind(self) -> None:
        d = self._dll
        params_p = ctypes.POINTER(FhFwdParams)
        d.fh_fwd.argtypes = [params_p, ctypes.c_void_p]
        d.fh_fwd.restype = ctypes.c_int
        d.fh_fwd_select_backend.argtypes = [
            params_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
            ctypes.c_char_p, ctypes.c_size_t,
        ]
        d.fh_fwd_select_backend.restype = ctypes.c_int
        d.fh_last_error.argtypes = []
        d.fh_last_error.restype = ctypes.c_char_p
        d.fh_abi_version.argtypes = []
        d.fh_abi_version.restype = ctypes.c_int32
        d.fh_build_info.argtypes = []
        d.fh_build_info.restype = ctypes.c_char_p
        d.fh_has_fwd_kernel.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64]
        d.fh_has_fwd_kernel.restype = ctypes.c_int32
        d.fh_debug_set_timeline.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        d.fh_debug_set_timeline.restype = ctypes.c_int
        bwd_p = ctypes.POINTER(FhBwdParams)
        d.fh_bwd.argtypes = [bwd_p, ctypes.c_void_p]
        d.fh_bwd.restype = ctypes.c_int
        d.fh_bwd_workspace_size.argtypes = [bwd_p, ctypes.POINTER(ctypes.c_int64)]
        d.fh_bwd_workspace_size.restype = ctypes.c_int
        d.fh_fwd_workspace_size.argtypes = [params_p, ctypes.POINTER(ctypes.c_int64)]
        d.fh_fwd_workspace_size.restype = ctypes.c_int
        d.fh_bwd_select_backend.argtypes = [
            bwd_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
            ctypes.c_char_p, ctypes.c_size_t,
        ]
        d.fh_bwd_select_backend.restype = ctypes.c_int
        d.fh_has_bwd_kernel.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64]
        d.fh_has_bwd_kernel.restype = ctypes.c_int32
        dec_p = ctypes.POINTER(FhDecodeParams)
        d.fh_decode.argtypes = [dec_p, ctypes.c_void_p]
        d.fh_decode.restype = ctypes.c_int
        d.fh_decode_plan.argtypes = [dec_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                     ctypes.POINTER(ctypes.c_int64)]
        d.fh_decode_plan.restype = ctypes.c_int
        d.fh_decode_stages.argtypes = [ctypes.c_int64, ctypes.c_int32]
        d.fh_decode_stages.restype = ctypes.c_int32
        d.fh_decode_select_backend.argtypes = [
            dec_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
            ctypes.c_char_p, ctypes.c_size_t,
        ]
        d.fh_decode_select_backend.restype = ctypes.c_int

    # --- raw calls (status codes), for tests of the ABI itself ---------------------------------
    def fwd_status(self, params: FhFwdParams, stream: int | None) -> int:
        return int(self._dll.fh_fwd(ctypes.byref(params), stream))

    def last_error(self) -> str:
        msg = self._dll.fh_last_error()
        return msg.decode("utf-8", "replace") if msg else ""

    # --- checked calls (raise on error) ---------------------------------------------------------
    def fwd(self, params: FhFwdParams, stream: int | None) -> None:
        """Launch the forward on ``stream`` (a cudaStream_t as int; None = legacy default)."""
        self.check(self.fwd_status(params, stream), "fh_fwd")

    def set_timeline(self, device_ptr: int | None, nbytes: int) -> None:
        """Debug: record the FA-3 forward's event timeline into this device buffer (None: stop).
        Only libraries built with FH_TIMELINE=ON record (others raise UnsupportedError); the
        layout and its reader are bench/timeline.py's."""
        self.check(self._dll.fh_debug_set_timeline(device_ptr, int(nbytes)),
                   "fh_debug_set_timeline")

    def policy(self, params: FhFwdParams | FhBwdParams | FhDecodeParams,
               capability: tuple[int, int]) -> tuple[FhBackend, str]:
        """(backend, reason) of the library's policy for ``params`` on a GPU of ``capability``:
        what fh_fwd (FhFwdParams; FhBackend.DECODE for a decode_route call the decode kernel
        serves) or fh_bwd (FhBwdParams) would run, or whether the decode kernel serves an
        FhDecodeParams call (FhBackend.DECODE).

        The library's own policy (fh_fwd_select_backend / fh_bwd_select_backend /
        fh_decode_select_backend): no GPU is touched, the data pointers are not read. Raises like
        fh_fwd / fh_bwd / fh_decode_plan for params nothing can serve.
        """
        if isinstance(params, FhBwdParams):
            select = self._dll.fh_bwd_select_backend
        elif isinstance(params, FhDecodeParams):
            select = self._dll.fh_decode_select_backend
        else:
            select = self._dll.fh_fwd_select_backend
        out = ctypes.c_int32(-1)
        reason = ctypes.create_string_buffer(_REASON_BYTES)
        status = select(
            ctypes.byref(params), int(capability[0]), int(capability[1]), ctypes.byref(out),
            reason, _REASON_BYTES,
        )
        if status != FhStatus.SUCCESS:  # the message names the field or the reason: no prefix
            raise status_error(int(status), self.last_error() or "(no message)")
        return FhBackend(out.value), reason.value.decode("utf-8", "replace")

    def select_backend(
        self, params: FhFwdParams, capability: tuple[int, int] | None = None
    ) -> FhBackend:
        """The backend fh_fwd would run for ``params`` on ``capability`` (default: the current
        CUDA device's), without launching."""
        if capability is None:
            import torch

            from . import _device

            capability = _device.device_info(torch.cuda.current_device()).capability
        return self.policy(params, capability)[0]

    def build_info(self) -> dict[str, Any]:
        """fh_build_info() parsed (api.h lists the keys)."""
        raw = self._dll.fh_build_info()
        return json.loads(raw.decode("utf-8")) if raw else {}

    def has_fwd_kernel(self, backend: int, dtype: int, head_dim: int) -> bool:
        """Whether this build holds a forward kernel for the head-dim bucket of ``head_dim``."""
        key = (int(backend), int(dtype), int(head_dim))
        found = self._has_kernel.get(key)
        if found is None:  # a build never changes: ask the library once per key
            found = self._has_kernel[key] = bool(self._dll.fh_has_fwd_kernel(*key))
        return found

    def has_bwd_kernel(self, backend: int, dtype: int, head_dim: int) -> bool:
        """Whether this build holds a backward kernel for the head-dim bucket of ``head_dim``."""
        key = (int(backend), int(dtype), int(head_dim))
        found = self._has_bwd_kernel.get(key)
        if found is None:
            found = self._has_bwd_kernel[key] = bool(self._dll.fh_has_bwd_kernel(*key))
        return found

    def bwd_status(self, params: FhBwdParams, stream: int | None) -> int:
        return int(self._dll.fh_bwd(ctypes.byref(params), stream))

    def bwd(self, params: FhBwdParams, stream: int | None) -> None:
        """Launch the backward on ``stream`` (a cudaStream_t as int; None = legacy default)."""
        self.check(self.bwd_status(params, stream), "fh_bwd")

    def bwd_workspace_size(self, params: FhBwdParams) -> int:
        """Bytes of workspace fh_bwd needs for ``params`` (pure host arithmetic: no GPU, data
        pointers and workspace not read). Raises like fh_bwd for invalid params."""
        size = ctypes.c_int64(-1)
        status = self._dll.fh_bwd_workspace_size(ctypes.byref(params), ctypes.byref(size))
        if status != FhStatus.SUCCESS:
            raise status_error(int(status), self.last_error() or "(no message)")
        return int(size.value)

    def fwd_workspace_size(self, params: FhFwdParams) -> int:
        """Bytes of workspace fh_fwd needs for ``params`` (0 for a dense call; pure host
        arithmetic). Raises like fh_fwd for invalid params."""
        size = ctypes.c_int64(-1)
        status = self._dll.fh_fwd_workspace_size(ctypes.byref(params), ctypes.byref(size))
        if status != FhStatus.SUCCESS:
            raise status_error(int(status), self.last_error() or "(no message)")
        return int(size.value)

    def decode(self, params: FhDecodeParams, stream: int | None) -> None:
        """Launch the decode kernel on ``stream`` (a cudaStream_t as int; None = legacy)."""
        self.check(int(self._dll.fh_decode(ctypes.byref(params), stream)), "fh_decode")

    def decode_plan(self, params: FhDecodeParams, num_sms: int = 0) -> tuple[int, int]:
        """(num_splits, workspace bytes) of a decode call: params.num_splits when > 0, else the
        library's choice for ``num_sms`` SMs (0: the current device's), from the shapes alone."""
        splits = ctypes.c_int32(-1)
        size = ctypes.c_int64(-1)
        status = self._dll.fh_decode_plan(ctypes.byref(params), int(num_sms),
                                          ctypes.byref(splits), ctypes.byref(size))
        if status != FhStatus.SUCCESS:
            raise status_error(int(status), self.last_error() or "(no message)")
        return int(splits.value), int(size.value)

    def decode_stages(self, head_dim: int, max_smem_per_block: int) -> int:
        """The decode kernel's key-ring stages at ``head_dim`` on a device allowing
        ``max_smem_per_block`` bytes of shared memory per block (> 0); 0: it does not fit."""
        return int(self._dll.fh_decode_stages(int(head_dim), int(max_smem_per_block)))

    def check(self, status: int, what: str) -> None:
        """Raise the Python exception that corresponds to an FhStatus (nothing on success)."""
        if status == FhStatus.SUCCESS:
            return
        text = self.last_error() or "(no message)"
        raise status_error(status, f"{what}: {text}")


# Room for the select functions' reasons: the longest is about 400 bytes (a layout problem).
_REASON_BYTES = 1024


def status_error(status: int, message: str) -> Exception:
    """The exception for a failing FhStatus (exposed for tests of the mapping)."""
    kinds = {
        FhStatus.ERROR_INVALID_ARGUMENT: ValueError,
        FhStatus.ERROR_UNSUPPORTED: UnsupportedError,
        FhStatus.ERROR_CUDA: CudaError,
        FhStatus.ERROR_INTERNAL: InternalError,
    }
    kind = kinds.get(status)
    if kind is None:
        return InternalError(f"{message} (unknown FhStatus {status})")
    return kind(message)


_lock = threading.Lock()
_library: Library | None = None


def loaded_path() -> Path | None:
    """Path of the library loaded in this process, or None if none was loaded yet."""
    return _library.path if _library is not None else None


def get_library() -> Library:
    """The process-wide Library, loaded on first use; raises LibraryNotFoundError if absent."""
    global _library
    loaded = _library
    if loaded is not None:  # every forward asks: no lock once loaded
        return loaded
    with _lock:
        if _library is None:
            path = find_library()
            if path is None:
                raise LibraryNotFoundError(_not_found_message())
            _library = Library(path)
        return _library
