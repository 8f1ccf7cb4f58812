"""`flash-hopper info`: what this machine has and which path flash_attn_func would take.

Works without a GPU and without the kernel library: each part says what it could not find and
why, and the command still exits 0 (it is the first thing to run when something does not work).
"""

from __future__ import annotations

import json
from typing import Callable

from . import env
from .backends import arch_digits
from .errors import first_line

# Hypothetical GPUs shown when there is no GPU to ask: one per path.
EXAMPLE_CAPABILITIES = ((9, 0), (8, 0))


def built_predicate(info: dict) -> Callable[[str, str, int], bool]:
    """dispatch.select_backend's `built` from build_info's lists (archs x dtypes x head dims).

    build_info does not say which (path, dtype, bucket) triples exist, only the sets, so this is
    an upper bound; on a GPU, which_backend asks the library itself.
    """
    archs = {arch_digits(a)[:2] for a in info.get("archs", ())}
    dtypes = {str(d) for d in info.get("dtypes", ())}
    head_dims = {int(d) for d in info.get("head_dims", ())}
    path_arch = {"fa3": "90", "fa2": "80"}

    def built(backend: str, dtype: str, bucket: int) -> bool:
        return path_arch[backend] in archs and dtype in dtypes and bucket in head_dims

    return built


def path_on_gpu(head_dim: int, dtype: str, backend: str, causal: bool) -> tuple[str, str]:
    """(path, reason) from which_backend on tiny tensors of the current GPU."""
    import torch

    import flash_hopper

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    q = torch.empty(1, 128, 1, head_dim, device="cuda", dtype=torch_dtype)
    name, reason = flash_hopper.which_backend(q, q, q, backend=backend, causal=causal)
    return str(name), str(reason)


def path_hypothetical(info: dict, capability, head_dim: int, dtype: str,
                      backend: str) -> tuple[str, str]:
    from flash_hopper.dispatch import select_backend

    return select_backend(backend, capability, built_predicate(info), dtype, head_dim)


def gather(head_dim: int, dtype: str, backend: str, causal: bool,
           capability: tuple[int, int] | None = None) -> dict[str, object]:
    report: dict[str, object] = {"query": {"head_dim": head_dim, "dtype": dtype,
                                           "backend": backend, "causal": causal}}
    torch, torch_reason = env.torch_status()
    report["torch"] = getattr(torch, "__version__", None) or torch_reason
    report["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        import flash_hopper

        report["package"] = {"version": flash_hopper.__version__,
                             "library_path": flash_hopper.library_path()}
    except Exception as exc:  # noqa: BLE001 - info reports every failure instead of raising
        report["package"] = {"error": first_line(exc)}
    report["library"] = env.library_info()
    gpu, gpu_reason = env.detect_gpu()
    report["gpu"] = None
    report["gpu_reason"] = gpu_reason
    if gpu is not None:
        report["gpu"] = {"name": gpu.name, "capability": list(gpu.capability),
                         "sm_count": gpu.sm_count, "memory_gib": gpu.memory_bytes / 2 ** 30,
                         "l2_mib": gpu.l2_bytes / 2 ** 20}
    report["driver"] = {"cuda_driver_api": env.driver_version(),
                        **{k: v for k, v in env.nvidia_smi(gpu).items()
                           if k in ("driver", "nvidia_smi_error")}}
    report["paths"] = _paths(report, gpu, head_dim, dtype, backend, causal, capability)
    return report


def _paths(report, gpu, head_dim, dtype, backend, causal, capability) -> list[dict[str, object]]:
    lib = report["library"]
    if "error" in lib:
        return [{"where": "any GPU", "error": f"library not loadable: {lib['error']}"}]
    paths = []
    targets = [capability] if capability else ([] if gpu else list(EXAMPLE_CAPABILITIES))
    if gpu is not None and not capability:
        entry: dict[str, object] = {"where": f"this GPU (cc {gpu.capability[0]}."
                                             f"{gpu.capability[1]})"}
        try:
            entry["path"], entry["reason"] = path_on_gpu(head_dim, dtype, backend, causal)
        except Exception as exc:  # noqa: BLE001 - the reason no path serves it is the answer
            entry["error"] = first_line(exc)
        paths.append(entry)
    for cap in targets:
        entry = {"where": f"a cc {cap[0]}.{cap[1]} GPU (hypothetical, from build_info)"}
        try:
            entry["path"], entry["reason"] = path_hypothetical(lib, cap, head_dim, dtype, backend)
        except Exception as exc:  # noqa: BLE001 - the reason no path serves it is the answer
            entry["error"] = first_line(exc)
        paths.append(entry)
    return paths


def render(report: dict[str, object]) -> str:
    lines = []
    package = report.get("package") or {}
    lines.append(f"flash-hopper {package.get('version', '?')}"
                 + (f"  ({package['error']})" if "error" in package else ""))
    lib = report["library"]
    if "error" in lib:
        lines.append(f"  library : not loadable: {lib['error']}")
    else:
        lines.append(f"  library : {package.get('library_path') or '?'}")
        lines.append(f"            version {lib.get('version')}, commit {lib.get('commit')}, "
                     f"CUDA {lib.get('cuda')}")
        lines.append(f"            kernels: archs {_join(lib.get('archs'))}; head dims "
                     f"{_join(lib.get('head_dims'))}; dtypes {_join(lib.get('dtypes'))}")
        for key in ("fa3_variants", "backward"):
            if key in lib:
                lines.append(f"            {key}: {lib[key]}")
    lines.append(f"  torch   : {report.get('torch')} (CUDA {report.get('torch_cuda') or 'none'})")
    gpu = report.get("gpu")
    if gpu is None:
        lines.append(f"  GPU     : no GPU ({report.get('gpu_reason')}); info works without one, "
                     "bench and demo need one")
    else:
        cap = gpu["capability"]
        lines.append(f"  GPU     : {gpu['name']}, compute capability {cap[0]}.{cap[1]} "
                     f"(sm{cap[0]}{cap[1]}), {gpu['sm_count']} SMs, "
                     f"{gpu['memory_gib']:.1f} GiB, L2 {gpu['l2_mib']:.0f} MiB")
    driver = report.get("driver") or {}
    lines.append(f"  driver  : {driver.get('driver') or 'unknown'}"
                 f" (CUDA driver API {driver.get('cuda_driver_api') or 'unknown'})")
    query = report["query"]
    lines.append(f"  path for head_dim={query['head_dim']} dtype={query['dtype']} "
                 f"backend={query['backend']} causal={query['causal']}:")
    for entry in report["paths"]:
        if "error" in entry:
            lines.append(f"    on {entry['where']}: none: {entry['error']}")
        else:
            lines.append(f"    on {entry['where']}: {entry['path']} ({entry['reason']})")
    return "\n".join(lines)


def _join(values) -> str:
    return " ".join(str(v) for v in (values or ())) or "none"


def run_info(args) -> int:
    report = gather(args.head_dim, args.dtype, args.backend, args.causal, args.capability)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
