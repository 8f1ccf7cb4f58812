"""`flash-hopper info`: what this machine has and which path flash_attn_func would take.

Works without a GPU and without the kernel library: each part says what it could not find and
why, and the command still exits 0 (it is the first thing to run when something does not work).
The path and its reason come from the library's own policy (kernels/src/policy.cu), asked for this GPU
(which_backend) or for a hypothetical one (dispatch.hypothetical: no GPU needed): the kernel family
flash_attn_func runs, "decode" for the decode kernel (its 128 query rows are short queries).
"""

from __future__ import annotations

import json
from typing import Any

from . import env
from .errors import first_line

# Hypothetical GPUs shown when there is no GPU to ask: one per path.
EXAMPLE_CAPABILITIES = ((9, 0), (8, 0))


def path_on_gpu(head_dim: int, dtype: Any, backend: str, causal: bool) -> tuple[str, str]:
    """(path, reason) from which_backend on tiny tensors of the current GPU; dtype: 16-bit, as a
    name ("bf16") or a torch dtype."""
    import torch

    import flash_hopper
    from flash_hopper import _tables

    torch_dtype = _tables.DTYPE_NAMES[_tables.canonical_dtype(dtype)]
    q = torch.empty(1, 128, 1, head_dim, device="cuda", dtype=torch_dtype)
    name, reason = flash_hopper.which_backend(q, q, q, backend=backend, causal=causal)
    return str(name), str(reason)


def path_hypothetical(capability, head_dim: int, dtype: Any, backend: str,
                      causal: bool) -> tuple[str, str]:
    """(path, reason) the library's policy gives on a GPU of ``capability``, without a GPU."""
    from flash_hopper import dispatch

    return dispatch.hypothetical(tuple(capability), dtype, head_dim, backend, causal)


def gather(head_dim: int, dtype: Any, backend: str, causal: bool,
           capability: tuple[int, int] | None = None) -> dict[str, object]:
    from flash_hopper._tables import canonical_dtype

    dtype = canonical_dtype(dtype)  # the report's name: "bf16" for torch.bfloat16 too
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
        entry = {"where": f"a cc {cap[0]}.{cap[1]} GPU (hypothetical: the library's policy)"}
        try:
            entry["path"], entry["reason"] = path_hypothetical(cap, head_dim, dtype, backend,
                                                               causal)
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
        if lib.get("gpu_code"):
            lines.append(f"            GPU code: {_gpu_code_text(lib['gpu_code'])}; link "
                         f"{lib.get('link', '?')}")
        for path_dtype, head_dims in _kernels_by_path(lib).items():
            lines.append(f"            {path_dtype}: head dims {_join(head_dims)}")
        decode = lib.get("decode")  # the decode kernel's table (every build has it; ABI 11)
        if decode:
            lines.append(f"            decode {_join(decode.get('dtypes'))}: head dims "
                         f"{_join(decode.get('head_dims'))} (at most {decode.get('max_rows')} "
                         f"packed rows)")
        for key in ("fa3_variants", "backward"):
            if key in lib:
                value = lib[key]
                lines.append(f"            {key}: "
                             f"{_join(value) if isinstance(value, list) else value}")
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


def _kernels_by_path(lib: dict) -> dict[str, list[int]]:
    """'fa3 bf16' (forward) / 'fa2 bf16 bwd' -> head dims with a kernel, from build_info's exact
    kernel list (entries without a "direction", from libraries before ABI 3, are forward)."""
    grouped: dict[str, list[int]] = {}
    for kernel in lib.get("kernels") or ():
        suffix = " bwd" if kernel.get("direction", "fwd") == "bwd" else ""
        grouped.setdefault(f"{kernel['backend']} {kernel['dtype']}{suffix}", []).append(
            kernel["head_dim"])
    return grouped


def _gpu_code_text(codes) -> str:
    """build_info's gpu_code in words: SASS runs on its own family, PTX by JIT on later GPUs."""
    sass = [c for c in codes if c.startswith("sm_")]
    ptx = [c for c in codes if c.startswith("compute_")]
    text = f"SASS {_join(sass)}" if sass else "no SASS"
    if ptx:
        text += (f", PTX {_join(ptx)} (the driver JIT-compiles it for newer GPUs, e.g. cc 10.x / "
                 "12.x run the FA-2 path that way)")
    return text


def _join(values) -> str:
    return " ".join(str(v) for v in (values or ())) or "none"


def run_info(args) -> int:
    report = gather(args.head_dim, args.dtype, args.backend, args.causal, args.capability)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
