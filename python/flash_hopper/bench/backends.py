"""Benchmark backends: the interface, flash-hopper's own paths, and the registry.

A backend answers, in this order: can it run in this process at all (`probe`: importable, built,
right GPU), can it run this configuration (`unsupported`), and then builds a zero-argument callable
for one configuration (`make_forward`) and names the kernel that actually runs (`kernel`). Every
"no" comes with a reason that the CLI prints and the result files record: nothing is skipped
silently. Torch and third-party backends live in peers.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional

from .errors import first_line

Capability = Optional[tuple[int, int]]

DEFAULT_BACKENDS = ("fa3", "fa2", "sdpa-flash", "sdpa-cudnn")
# Module-style spellings people will type, mapped to backend names.
ALIASES = {
    "flash_attn": "flash-attn",
    "flash-attn2": "flash-attn",
    "flash_attn_interface": "flash-attn3",
    "flash_attn_3": "flash-attn3",
    "flash_attn.cute": "flash-attn-cute",
    "sdpa": "sdpa-flash",
    "cudnn": "sdpa-cudnn",
}
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "bf16": "bf16",
                "fp16": "fp16"}


class Backend:
    name = ""
    label = ""  # plot legend
    origin = ""  # flash-hopper | torch | external
    min_capability: tuple[int, int] = (8, 0)
    # Set when the backend only runs on one architecture family (FA3-style sm90 kernels).
    only_major: int | None = None

    def software_reason(self) -> str | None:
        """Why this backend cannot run in this process regardless of the GPU, or None."""
        return None

    def runtime_reason(self) -> str | None:
        """Checks that need the GPU runtime (e.g. torch's kernel availability), or None."""
        return None

    def probe(self, capability: Capability) -> str | None:
        reason = self.software_reason()
        if reason:
            return reason
        if capability is None:
            return "no CUDA GPU visible"
        if self.only_major is not None and capability[0] != self.only_major:
            return (f"needs an sm{self.only_major}x GPU; this one is "
                    f"sm{capability[0]}{capability[1]}")
        if tuple(capability) < self.min_capability:
            return (f"needs compute capability >= {self.min_capability[0]}."
                    f"{self.min_capability[1]}; this GPU has {capability[0]}.{capability[1]}")
        return self.runtime_reason()

    def version(self) -> str | None:
        return None

    def unsupported(self, case, direction: str | None = None) -> str | None:
        """Why this configuration (and direction, when given) cannot be timed, or None."""
        return None

    def make_forward(self, q, k, v, case) -> Callable[[], object]:
        """A callable computing attention on (batch, seqlen, heads, head_dim) tensors; it returns
        the output in the same layout."""
        raise NotImplementedError

    def kernel(self, q, k, v, case) -> tuple[str, str]:
        """(kernel name, why) for what actually runs."""
        return self.name, ""


class FlashHopperBackend(Backend):
    """flash_hopper.flash_attn_func with a forced path: "fa3", "fa2" or an fa3 ablation variant.

    Variants are whatever build_info()["fa3_variants"] lists; each is passed verbatim as the
    `backend=` argument of flash_attn_func.
    """

    origin = "flash-hopper"

    def __init__(self, name: str, path: str, variant: bool = False):
        self.name = name
        self.label = name
        self.path = path
        self.variant = variant
        self.only_major = 9 if name.startswith("fa3") else None
        self._info: dict | None = None

    def build_info(self) -> dict:
        if self._info is None:
            import flash_hopper

            self._info = dict(flash_hopper.build_info())
        return self._info

    def software_reason(self) -> str | None:
        try:
            info = self.build_info()
        except Exception as exc:  # noqa: BLE001 - any load failure: unavailable, with its reason
            return f"flash-hopper library not loadable: {first_line(exc)}"
        archs = [str(a) for a in info.get("archs", ())]
        if self.variant:
            variants = variant_names(info)
            if self.name not in variants:
                return (f"not in this build's fa3_variants "
                        f"({', '.join(variants) if variants else 'none reported'})")
        wanted = "90" if self.name.startswith("fa3") else "80"
        if not any(arch_digits(a).startswith(wanted) for a in archs):
            return (f"library built without sm{wanted} kernels "
                    f"(archs: {', '.join(archs) or 'none'})")
        return None

    def version(self) -> str | None:
        if self.software_reason() is not None:
            return None
        info = self.build_info()
        commit = info.get("commit")
        return f"{info.get('version')}" + (f" ({commit})" if commit else "")

    def unsupported(self, case, direction: str | None = None) -> str | None:
        info = self.build_info()
        dtypes = {_DTYPE_NAMES.get(str(d), str(d)) for d in info.get("dtypes", ())}
        if dtypes and case.dtype not in dtypes:
            return f"library built without {case.dtype} (dtypes: {', '.join(sorted(dtypes))})"
        bucket_reason = self._head_dim_reason(info, case.head_dim)
        if bucket_reason:
            return bucket_reason
        if direction and "bwd" in direction and not info.get("backward"):
            return "backward not available in flash-hopper yet"
        return None

    @staticmethod
    def _head_dim_reason(info: dict, head_dim: int) -> str | None:
        built = [int(d) for d in info.get("head_dims", ())]
        if not built:
            return None
        try:
            from flash_hopper.dispatch import head_dim_bucket

            bucket = head_dim_bucket(head_dim)
        except (ImportError, ValueError):  # no dispatch module, or d > 256: the call decides
            return None
        if bucket not in built:
            return (f"library built without head-dim bucket {bucket} for d={head_dim} "
                    f"(built: {', '.join(map(str, built))})")
        return None

    def _call_kwargs(self, case) -> dict:
        return {"causal": case.causal, "window_size": tuple(case.window),
                "softcap": case.softcap, "backend": self.path}

    def make_forward(self, q, k, v, case):
        from flash_hopper import flash_attn_func

        kwargs = self._call_kwargs(case)
        return lambda: flash_attn_func(q, k, v, **kwargs)

    def kernel(self, q, k, v, case) -> tuple[str, str]:
        from flash_hopper import which_backend

        kwargs = self._call_kwargs(case)
        try:
            name, reason = which_backend(q, k, v, **kwargs)
        except TypeError:  # an older which_backend taking only `backend`
            name, reason = which_backend(q, k, v, backend=self.path)
        return str(name), str(reason)


def arch_digits(arch: str) -> str:
    """'sm90a' / 'sm_90a' / '90a' -> '90a': build_info spellings vary, the digits do not."""
    return str(arch).lower().replace("sm_", "").replace("sm", "")


def variant_names(info: dict) -> list[str]:
    """fa3 ablation variants reported by the build (a list or a name -> description dict)."""
    raw = info.get("fa3_variants") or ()
    return [str(v) for v in raw]


def _builtin_backends() -> dict[str, Backend]:
    from . import peers

    backends: dict[str, Backend] = {
        "fa3": FlashHopperBackend("fa3", "fa3"),
        "fa2": FlashHopperBackend("fa2", "fa2"),
    }
    for kind in peers.SDPA_KINDS:
        backend = peers.SdpaBackend(kind)
        backends[backend.name] = backend
    backends["flex"] = peers.FlexBackend()
    for backend in peers.external_backends():
        backends[backend.name] = backend
    return backends


def registry(include_variants: bool = True) -> dict[str, Backend]:
    """All known backends by name, plus the fa3 variants the loaded library reports."""
    backends = _builtin_backends()
    if include_variants:
        try:
            import flash_hopper

            info = dict(flash_hopper.build_info())
        except Exception:  # noqa: BLE001 - no library: no variants; fa3/fa2 report why
            info = {}
        for variant in variant_names(info):
            backends[variant] = FlashHopperBackend(variant, variant, variant=True)
    return backends


def canonical_name(name: str) -> str:
    return ALIASES.get(name, name)


def resolve(names: Sequence[str], known: dict[str, Backend] | None = None) -> list[Backend]:
    """Backends for CLI names, in the given order; 'all' expands to every known backend.

    An unknown name starting with 'fa3' is kept as a variant (it then probes as unavailable, with
    the build's variant list as the reason) so a script asking for an ablation does not crash on
    a build without it; any other unknown name is a usage error.
    """
    known = registry() if known is None else known
    chosen: list[Backend] = []
    for raw in names:
        if raw == "all":
            candidates = list(known.values())
        else:
            name = canonical_name(raw)
            if name in known:
                candidates = [known[name]]
            elif name.startswith("fa3"):
                candidates = [FlashHopperBackend(name, name, variant=True)]
            else:
                raise ValueError(f"unknown backend {raw!r}; known: {', '.join(known)}, all")
        for backend in candidates:
            if all(b.name != backend.name for b in chosen):
                chosen.append(backend)
    return chosen
