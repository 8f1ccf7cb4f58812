"""Environment metadata stored with every result file, and GPU detection shared by the commands.

Numbers without their conditions are not comparable: the same kernel differs by 10-20 % between an
H100 at 700 W and one power-capped, or between driver versions. So every file records the GPU,
its current and maximum SM clocks and power limit (nvidia-smi), driver, CUDA, torch, python, the
library build (version, commit, archs) and the command line that reproduces it.
"""

from __future__ import annotations

import datetime
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass

from .errors import first_line

# nvidia-smi fields, in query order, and the key each gets in the metadata.
_SMI_FIELDS = (
    ("name", "name"), ("driver_version", "driver"), ("clocks.sm", "sm_clock_mhz"),
    ("clocks.max.sm", "sm_clock_max_mhz"), ("clocks.mem", "mem_clock_mhz"),
    ("power.limit", "power_limit_w"), ("temperature.gpu", "temperature_c"),
    ("persistence_mode", "persistence_mode"),
)


@dataclass
class GpuInfo:
    index: int
    name: str
    capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    l2_bytes: int
    uuid: str = ""

    @property
    def arch(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"


def torch_status() -> tuple[object | None, str]:
    """(torch module or None, why not)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from a broken CUDA lib
        return None, f"torch is not importable: {first_line(exc)}"
    return torch, ""


def detect_gpu(index: int | None = None) -> tuple[GpuInfo | None, str]:
    """(GpuInfo, "") for the current CUDA device, or (None, a one-line reason there is none)."""
    torch, reason = torch_status()
    if torch is None:
        return None, reason
    if torch.version.cuda is None:
        return None, f"this torch ({torch.__version__}) is a CPU-only build"
    try:
        available = torch.cuda.is_available()
    except RuntimeError as exc:
        return None, f"CUDA initialisation failed: {first_line(exc)}"
    if not available:
        return None, "no CUDA device visible (torch.cuda.is_available() is False)"
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    return GpuInfo(index=index, name=props.name, capability=(props.major, props.minor),
                   sm_count=props.multi_processor_count, memory_bytes=props.total_memory,
                   l2_bytes=int(getattr(props, "L2_cache_size", 0) or 0),
                   uuid=str(getattr(props, "uuid", "") or "")), ""


def nvidia_smi(gpu: GpuInfo | None) -> dict[str, object]:
    """Clocks, power limit and driver from nvidia-smi, for the same GPU torch uses (by UUID,
    since CUDA_VISIBLE_DEVICES renumbers devices). Empty when nvidia-smi is absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    cmd = [exe, "--query-gpu=" + ",".join(f for f, _ in _SMI_FIELDS),
           "--format=csv,noheader,nounits"]
    if gpu is not None and gpu.uuid:
        uuid = gpu.uuid if gpu.uuid.startswith("GPU-") else f"GPU-{gpu.uuid}"
        cmd.append(f"--id={uuid}")
    elif gpu is not None:
        cmd.append(f"--id={gpu.index}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return {"nvidia_smi_error": first_line(exc)}
    line = out.strip().splitlines()[0] if out.strip() else ""
    values = [v.strip() for v in line.split(",")]
    return {key: _number(value) for (_, key), value in zip(_SMI_FIELDS, values)}


def _number(text: str):
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def driver_version() -> str | None:
    """CUDA driver API version (e.g. '12.8') through cuda-python, None if unavailable."""
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if int(err) != 0:
            return None
        return f"{version // 1000}.{(version % 1000) // 10}"
    except (ImportError, RuntimeError, OSError):  # no cuda-python, or no libcuda
        return None


def library_info() -> dict[str, object]:
    try:
        import flash_hopper

        return dict(flash_hopper.build_info())
    except Exception as exc:  # noqa: BLE001 - metadata is best effort: record why
        return {"error": first_line(exc)}


def package_versions() -> dict[str, str]:
    """Versions of the peers that may be benchmarked, read from metadata (no import cost)."""
    from importlib import metadata

    found = {}
    for dist in ("triton", "flash-attn", "flash_attn_3", "nvidia-cudnn-cu12", "cuda-bindings"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def collect(command: str = "", include_hostname: bool = True) -> dict[str, object]:
    torch, _ = torch_status()
    gpu, gpu_reason = detect_gpu()
    meta: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": getattr(torch, "__version__", None),
        "torch_cuda": getattr(getattr(torch, "version", None), "cuda", None),
        "cudnn": _cudnn_version(torch),
        "cuda_driver_api": driver_version(),
        "packages": package_versions(),
        "library": library_info(),
        "gpu": asdict(gpu) if gpu else None,
        "gpu_reason": gpu_reason,
        "nvidia_smi": nvidia_smi(gpu) if gpu else {},
    }
    if include_hostname:
        meta["hostname"] = socket.gethostname()
    return meta


def _cudnn_version(torch) -> int | None:
    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except (AttributeError, RuntimeError):  # no torch, or cuDNN failing to load
        return None
