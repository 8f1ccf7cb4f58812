"""Device queries for dispatch: compute capability, SM count, opt-in shared memory, driver.

cuda-python (``cuda.bindings.driver``; ``cuda.cuda`` on cuda-python < 12.6) is the first choice:
it asks the driver directly, gives the opt-in shared-memory limit the kernels size their pipelines
against and the driver version. When it is missing or fails, torch.cuda answers what it can.

Policy on a machine without a GPU: this module imports fine, and every query raises
``DeviceQueryError`` with the reasons each source gave. A query never returns a made-up value:
dispatch on a guessed compute capability would pick a kernel that cannot run.

Results are cached per device index (the properties of a device do not change while a process
lives; CUDA_VISIBLE_DEVICES renumbers devices for torch and the driver alike).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ._errors import DeviceQueryError

# What a failing query raises: DeviceQueryError (a failing CUresult, bad index), cuda-python's
# DynamicLibNotFoundError (a RuntimeError) without libcuda, torch's RuntimeError/AssertionError.
_QUERY_ERRORS = (RuntimeError, OSError, AttributeError, ValueError, AssertionError)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    capability: tuple[int, int]
    sm_count: int
    max_smem_per_block_optin: int | None  # bytes; None if the source cannot tell
    driver_version: int | None  # CUDA's encoding, 1000 * major + 10 * minor; None if unknown
    source: str  # "cuda.bindings", "cuda.cuda" or "torch.cuda"


def _driver_module() -> Any:
    """cuda-python's driver module, or None if cuda-python is not installed."""
    try:
        from cuda.bindings import driver

        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver  # cuda-python < 12.6

        return driver
    except ImportError:
        return None


def cu_error_message(result: Any) -> str:
    """A readable message for a CUresult: 'CUDA_ERROR_NO_DEVICE (100): no CUDA-capable ...'.

    Works without a loaded driver too (then only the enum's name and code are known).
    """
    code = int(result)
    name = getattr(result, "name", None) or f"CUresult {code}"
    drv = _driver_module()
    text = ""
    if drv is not None:
        try:
            err, s = drv.cuGetErrorString(drv.CUresult(code))
            if int(err) == 0 and s:
                text = s.decode() if isinstance(s, bytes) else str(s)
        except (RuntimeError, OSError, AttributeError):  # no libcuda: strings live in the driver
            text = ""
    return f"{name} ({code}): {text}" if text else f"{name} ({code})"


def _check_cu(ret: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    """Unpack a cuda-python (CUresult, *values) tuple, raising on a failing CUresult."""
    err, rest = ret[0], ret[1:]
    if int(err) != 0:
        raise DeviceQueryError(f"{what} failed: {cu_error_message(err)}")
    return rest


def _query_cuda_python(drv: Any, index: int, source: str) -> DeviceInfo:
    _check_cu(drv.cuInit(0), "cuInit")
    (count,) = _check_cu(drv.cuDeviceGetCount(), "cuDeviceGetCount")
    if not 0 <= index < count:
        raise DeviceQueryError(f"device index {index} out of range: {count} CUDA device(s)")
    (dev,) = _check_cu(drv.cuDeviceGet(index), "cuDeviceGet")
    attr = drv.CUdevice_attribute

    def get(a: Any) -> int:
        (value,) = _check_cu(drv.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a})")
        return int(value)

    (raw_name,) = _check_cu(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = raw_name.split(b"\0", 1)[0].decode() if isinstance(raw_name, bytes) else str(raw_name)
    (version,) = _check_cu(drv.cuDriverGetVersion(), "cuDriverGetVersion")
    return DeviceInfo(
        index=index,
        name=name,
        capability=(
            get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        ),
        sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        max_smem_per_block_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        driver_version=int(version),
        source=source,
    )


def _query_torch(index: int) -> DeviceInfo:
    import torch

    if not torch.cuda.is_available():
        raise DeviceQueryError("torch.cuda.is_available() is False")
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise DeviceQueryError(f"device index {index} out of range: {count} CUDA device(s)")
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    return DeviceInfo(
        index=index,
        name=props.name,
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        max_smem_per_block_optin=int(smem) if smem is not None else None,
        driver_version=None,
        source="torch.cuda",
    )


@functools.cache
def device_info(index: int) -> DeviceInfo:
    """Properties of CUDA device ``index``; raises DeviceQueryError when none can be queried."""
    reasons = []
    drv = _driver_module()
    if drv is None:
        reasons.append("cuda-python: not installed (pip install 'flash-hopper[cuda]')")
    else:
        source = "cuda.bindings" if drv.__name__.startswith("cuda.bindings") else "cuda.cuda"
        try:
            return _query_cuda_python(drv, index, source)
        except _QUERY_ERRORS as e:  # a missing libcuda raises, it returns no CUresult
            reasons.append(f"cuda-python: {e}")
    try:
        return _query_torch(index)
    except _QUERY_ERRORS as e:
        reasons.append(f"torch.cuda: {e}")
    raise DeviceQueryError(
        f"cannot query CUDA device {index} (flash-hopper kernels need an NVIDIA GPU with "
        "compute capability >= 8.0 and its driver):\n  " + "\n  ".join(reasons)
    )


def grid_cap(device: Any, sm_margin: int) -> int:
    """The persistent kernels' grid cap (FhFwdParams / FhBwdParams num_sms) for FA3's
    sm_margin, the SMs to leave free (for communication kernels beside attention): 0 (every SM)
    without a margin, else the device's SMs less the margin."""
    if not sm_margin:
        return 0
    if device.index is not None:
        index = device.index
    else:
        import torch

        index = torch.cuda.current_device()
    sms = device_info(index).sm_count
    if sm_margin >= sms:
        raise ValueError(f"sm_margin: expected fewer than the device's {sms} SMs, got "
                         f"{sm_margin}")
    return sms - sm_margin


def driver_version() -> tuple[int, int] | None:
    """The driver's CUDA version as (major, minor), or None when no source can tell."""
    drv = _driver_module()
    if drv is None:
        return None
    try:
        (version,) = _check_cu(drv.cuDriverGetVersion(), "cuDriverGetVersion")
    except _QUERY_ERRORS:
        return None
    return int(version) // 1000, (int(version) % 1000) // 10
